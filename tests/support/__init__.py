"""Helpers the tests share (not tests themselves).

- `support.oracle`: brute-force reference answers for the drafter tests;
- `support.frozen_engine`: freezing a server's engine, running it a step at a time and reading what is in
  flight, to act mid-generation;
- `support.weight_swap`: swapping the shared tiny server's weights, and putting them back after;
- `support.engine_jobs`: a script that runs jobs on a fresh vLLM engine (a module's ``engine_plan``, run in
  ``conftest.planned_engine_runs``);
- `support.pypi_source`, `support.ascend_source`: released sources from PyPI, sha256 pinned and cached;
- `support.vllm_contract`, `support.vllm_probe`: reading a vLLM release's source with ``ast``, and
  running the server's code on it in a subprocess.

Starting and stopping real servers is `samrollout.testing` (the benchmarks use it too).
``tests/`` is on ``sys.path`` under pytest (its files are not a package), so these import as ``support.*``.
"""
