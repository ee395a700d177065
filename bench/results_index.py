"""Write `bench/results/README.md`: every result file, current or superseded, with what it shows, the docs pages
that cite it, the commit that produced it and the command that did.

    python bench/results_index.py

Result files are never edited by hand, so the last commit that changed a file's content is the code that produced
it (give or take uncommitted changes of the day, which the file's own ``commit`` field, where it has one, names).
A file that records no command gets one here (`KNOWN_COMMANDS`), found in the docs, in a script's docstring or in
the commit that added the file, or rebuilt from the options the file records.  A file that nothing here
describes stops the index: describe it in `CURRENT` or `SUPERSEDED` first.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
ARCHIVE = RESULTS / "archive"
# The pages whose citations the index lists.
PAGES = [*sorted(ROOT.glob("docs/*.md")), ROOT / "README.md"]

# The files the docs' current claims rest on, and what each shows; a plot is listed with its JSON (`plot_of`).
CURRENT = {
    "soak-cpu.json": "a 30-minute soak with the key and the trainer's port: mixed rollouts, weight pushes, bad "
                     "requests and issue 59's hostile calls; requests lost, worst /health latency, RSS (issue 59)",
    "replay-gap-skyt1-clean-k3-4groups.json": "where sam-adaptive's extra steps over oracle(own+group) fall, by "
                                              "response position (Sky-T1 clean, 4 groups, k = 3; bench/replay_gap.py)",
    "replay-r1distill-k16-adaptive.json": "replay at equal k = 16, every round, R1-distill: sam-adaptive and "
                                          "sam-counted against sam-group, suffix-cache and oracle(own+group)",
    "replay-r1distill-k3-adaptive.json": "replay at equal k = 3, every round, R1-distill: sam-adaptive and "
                                         "sam-counted against sam-group, suffix-cache and oracle(own+group)",
    "replay-r1distill-k3-reach.json": "replay at equal k = 3, every round, R1-distill: sam-counted with the "
                                      "agreement evidence against sam-adaptive, sam-group, suffix-cache and "
                                      "oracle(own+group) (issue 58)",
    "replay-r1distill-k16-reach.json": "replay at equal k = 16, every round, R1-distill: sam-counted with the "
                                       "agreement evidence against sam-adaptive, sam-group, suffix-cache and "
                                       "oracle(own+group) (issue 58)",
    "replay-skyt1-clean-k3-reach.json": "replay at equal k = 3, every round, Sky-T1 clean: sam-counted with the "
                                        "agreement evidence against sam-adaptive, sam-group, suffix-cache and "
                                        "oracle(own+group) (issue 58)",
    "replay-skyt1-clean-k16-reach.json": "replay at equal k = 16, every round, Sky-T1 clean, all 30 groups: "
                                         "sam-counted with the agreement evidence against sam-adaptive, sam-group, "
                                         "suffix-cache and oracle(own+group) (issue 58)",
    "replay-skyt1-all-3groups-k3-adaptive.json": "replay at equal k = 3, every round, Sky-T1 all responses, first 3 "
                                                 "groups: the adaptive drafters against sam-group and the oracle",
    "replay-skyt1-clean-10groups-k16-adaptive.json": "replay at equal k = 16, every round, "
                                                     "Sky-T1 clean, first 10 groups: the adaptive drafters "
                                                     "against sam-group, suffix-cache and the oracle",
    "replay-skyt1-clean-k3-adaptive.log": "the log of the full Sky-T1 clean k = 3 adaptive replay (stopped before "
                                          "its JSON was written)",
    "cpu-engine-vs-peers.json": "the CPU engine: the default against no speculation, vLLM `suffix` and the static "
                                "mode, greedy and sampled",
    "engine-cost-cpu.json": "the CPU engine's cost table, measured through the engine (the simulator's calibration)",
    "grpo-cpu.json": "a real GRPO run on 2 CPU cores, sync against async",
    "grpo-trace-value.json": "what cross-epoch history and placement are worth on the GRPO run's traces",
    "projected-h100.json": "one synchronous step on the H100 table, every drafter, charged at 0 and at the reference "
                           "host's speed",
    "projected-rl-h100.json": "RL loops at scale on the H100 table, like for like and as products",
    "simulator-calibration-cpu.json": "the rollout simulator against the CPU engine, the static mode's modes (not run "
                                      "again with the adaptive policy)",
    "simulator-calibration-cpu-measured.json.gz": "the measured rounds behind `simulator-calibration-cpu.json`, every "
                                                  "request's tokens (its `--measured`)",
    "simulator-rl-calibration-cpu.json": "the RL-loop simulator against real servers, the static mode (not run again "
                                         "with the adaptive policy)",
    "simulator-rl-calibration-cpu-measured": "the measured half behind `simulator-rl-calibration-cpu.json`: the CPU "
                                             "table, the rounds and every group they ran (its `--measured`)",
    "verify-cost-cpu-k16.json": "what verifying k = 1-16 drafts costs on the 2-core CPU (SmolLM2, one thread): the "
                                "CPU draft range and `min_match_length`",
    "verify-cost-h100-k24.json": "the H100 cost table the projections and the CUDA cost prior use",
    "verify-cost-h100.json": "the H100 cost table up to k = 8 (the tests' table)",
    "weight-push-fanout-cpu.json": "a relayed weight push to 1 and 4 servers",
}

# Earlier measurements (in archive/) that the current code no longer reproduces: older defaults, older simulator
# versions, runs repeated since.  Kept as the record the docs' history sections cite.
SUPERSEDED = {
    "areal-engines-cpu.json": "AReaL's engine against samrollout's on the same 2 CPU servers, epoch by epoch",
    "async-rollout-cpu.json": "the RL loops on the CPU: sync-wait against async-continue and async-continue-keep-kv",
    "async-rollout-staleness-cpu.json": "async-continue unbounded and at max_staleness 2 and 1 (the default, 2)",
    "draft-variants.json": "draft variants tried for a higher tail MAL on the real traces (k = 16, history 2)",
    "http-overhead-smollm2-cpu.json": "the served path against the engine alone and plain `vllm serve`, tokens/s",
    "projected-h100-static-2026-11-27.json": "one synchronous step on the H100 table, the static mode's defaults",
    "projected-rl-h100-static-2026-11-28.json": "RL loops on the H100 table, the static mode's defaults",
    "replay-confident0-k3.json": "replay of the real traces, no drafts past the threshold (confident_match 0), k = 3",
    "replay-confident0-k8.json": "replay of the real traces, confident_match 0, k = 8",
    "replay-confident8-k3.json": "replay of the real traces, confident_match 8, k = 3",
    "replay-confident8-k8.json": "replay of the real traces, confident_match 8, k = 8",
    "replay-confident16-k3.json": "replay of the real traces, confident_match 16, k = 3",
    "replay-confident16-k8.json": "replay of the real traces, confident_match 16, k = 8",
    "replay-global-k8.json": "replay with the global index of earlier responses (`sam-global`), k = 8",
    "replay-global-k16.json": "replay with the global index of earlier responses (`sam-global`), k = 16",
    "replay-history.json": "replay with cross-epoch history (an earlier rollout, `--history 2`), the engine's k",
    "replay-history-k8.json": "replay with cross-epoch history (an earlier rollout, `--history 2`), k = 8",
    "replay-k16-recent.json": "`sam-history` drafting the latest occurrence (the default), k = 16, against "
                              "`suffix-cache`",
    "replay-k16-frequent.json": "`sam-history` drafting the most frequent continuation, k = 16",
    "replay-k16-frequent-p01.json": "`sam-history` drafting the most frequent continuation, k = 16, cut at "
                                    "min_probability 0.1",
    "replay-reasoning-traces.json": "every drafter on the real reasoning traces (Sky-T1, R1-distill) as the engine "
                                    "drafted then",
    "replay-reasoning-traces-k3-every-round.json": "every drafter on the real reasoning traces at k = 3 in every "
                                                   "round (no threshold)",
    "replay-reasoning-traces-k16-scaled.json": "ours and suffix-cache on the real reasoning traces at k = 16, drafts "
                                               "scaled to the match (match_scale 1)",
    "replay-smollm2.json": "every drafter on the bundled SmolLM2 traces as the engine drafted then",
    "replay-smollm2-k3-every-round.json": "every drafter on the bundled SmolLM2 traces at k = 3 in every round (no "
                                          "threshold)",
    "rollout-cost-cpu.json": "a sampled and a greedy rollout (64 groups x 8) through the server, SAM on against off",
    "rollout-cost-sync-cpu.json": "the sampled rollout with `off-sync` too: SAM on slowed it, drafting nothing",
    "scheduling-cpu.json": "rollout scheduling on one CPU server: fcfs against length-aware, with and without SAM",
    "scheduling-cpu-2-affine.json": "two servers: least-outstanding against affine placement of the groups",
    "scheduling-cpu-2-endpoints.json": "two servers: least-outstanding, predicted-work and divided placement",
    "scheduling-cpu-2-per-slot.json": "the single-server modes at 120 slots and 128 tokens",
    "scheduling-cpu-confident-8.json": "the single-server modes with confident_match 8",
    "scheduling-cpu-divided.json": "divided rollout against predicted-work placement on 2 servers",
    "scheduling-cpu-kv-short.json": "fcfs, length-aware and vLLM's priority scheduling short of KV memory",
    "scheduling-cpu-sampled.json": "the scheduling run sampled at temperature 1 (the default then)",
    "scheduling-cpu-short-first.json": "fcfs and length-aware with the requests shortest first",
    "scheduling-cpu-single-server.json": "fcfs and length-aware, each with and without SAM, on one server",
    "scheduling-cpu-single-server-5-rounds.json": "fcfs and length-aware, each with and without SAM, on one "
                                                  "server, 5 rounds",
    "simulate-rl-draft-length-h100.json": "RL loops on the H100 table at draft lengths 8 and 16",
    "simulate-rl-runtime-sky-all-4x.json": "the RL simulator's own runtime: Sky-T1, all responses, 4 instances",
    "simulated-cpu-draft-range.json": "the rollout simulator on the CPU table: draft ranges against the defaults",
    "soak-cpu.json": "a 30-minute soak (mixed load, weight pushes, bad requests): losses and leaks",
    "soak-cpu-60min-pushes.json": "a 60-minute soak with weight pushes",
    "soak-cpu-60min-no-pushes.json": "a 60-minute soak without weight pushes",
    "spec-engine-cpu.json": "SAM in the CPU engine against off, ngram and suffix (static, adaptive, min match 1)",
    "spec-engine-cpu-all-cores.json": "the CPU engine with its worker on both cores: off, static, confident 16, suffix",
    "spec-engine-cpu-all-cores-adaptive.json": "both cores: the adaptive policy and always-draft against off, suffix",
    "spec-engine-cpu-all-cores-global.json": "both cores: always-draft with the global index against suffix",
    "spec-engine-cpu-all-cores-steps.json": "both cores: engine steps of static, static min match 1 and suffix",
    "spec-engine-cpu-batch64.json": "throughput at batch 64, off against static, 5 rounds",
    "spec-engine-cpu-confident.json": "confident drafts past the threshold (16, 32) against static, off and suffix",
    "spec-engine-cpu-confident-8.json": "confident_match 8 and 16 (and the global index) in the CPU engine",
    "spec-engine-cpu-confident-history.json": "confident 16 with the cross-epoch history joined at a group's first "
                                              "step",
    "spec-engine-cpu-default.json": "the CPU engine with confident drafts as the default",
    "spec-engine-cpu-fp32.json": "the server's defaults, static and suffix on the float32 CPU",
    "spec-engine-cpu-nogroups.json": "the first interleaved 3-round run, without group ids",
    "spec-engine-cpu-policy.json": "min_match_length 2 against the static default, off and suffix",
    "spec-engine-cpu-sampled.json": "a sampled rollout (temperature 1, GRPO groups): SAM, off and suffix",
    "verify-cost-cpu.json": "what verifying k = 1-8 drafts costs on the 2-core CPU (`verify-cost-cpu-k16.json` "
                            "repeats it up to 16)",
    "weight-fanout-cpu.json": "a weight push to 3 servers, direct against relayed, at loopback and 1 Gbit/s",
    "weight-push-cpu.json": "weight updates on one server: the shared disk against the three HTTP push paths",
}

# Plots not named after their JSON (``X.png`` belongs to ``X.json`` otherwise).
PLOTS = {"grpo-cpu-sync.png": "grpo-cpu.json", "grpo-cpu-async.png": "grpo-cpu.json"}

# The command of each file that records none (path under results/: (command, where it comes from)).  $R is
# ../shared/data/reasoning-traces, the long reasoning traces outside this repository.
_REPLAY = ("samrollout replay --traces $R/skyt1-ckpt-aime24.jsonl.gz,$R/r1distill-math-samples.jsonl.gz "
           '--tokenizer "$(samrollout model smollm2)" --responses both')
_CONFIDENT = _REPLAY + " --drafters sam-group,suffix-cache --oracle-sources '' --long-context ''"
_HISTORY = _REPLAY + " --oracle-sources '' --long-context '' --history 2"
_ORACLES = "--oracle-sources own,group --oracle-sources own,group,suffix-cache"
_SPEC = "python bench/spec_engine.py --modes"
_REBUILT = "rebuilt from the options it records"
KNOWN_COMMANDS = {
    "engine-cost-cpu.json": (
        "python bench/engine_cost.py --engine plain --lengths 64,256,768 --batches 1,2,4,8,16,32 --qs 1,2,3,4 "
        "--json bench/results/engine-cost-cpu.json",
        "the grid bench/simulator_calibration.py runs (docs/simulator.md: measured at the start of its run)"),
    "simulator-calibration-cpu.json": (
        "python bench/simulator_calibration.py --modes off,sam-static,sam-static-only,sam-always,sam-adaptive,ngram,"
        "suffix --cost bench/results/simulator-calibration-cpu.json --measured "
        "bench/results/simulator-calibration-cpu-measured.json.gz --json bench/results/simulator-calibration-cpu.json "
        "--plot bench/results/simulator-calibration-cpu.png", _REBUILT + ": the simulated half redone"),
    "simulator-calibration-cpu-measured.json.gz": (
        "python bench/simulator_calibration.py --modes off,sam-static,sam-static-only,sam-always,sam-adaptive,ngram,"
        "suffix --rounds 3 --json bench/results/simulator-calibration-cpu.json --plot "
        "bench/results/simulator-calibration-cpu.png", "docs/simulator.md, with the modes it records"),
    "simulator-rl-calibration-cpu-measured": (
        'python bench/simulator_rl_calibration.py --servers 2 --rounds 3 --cost-args "--lengths 64,256,768 '
        '--batches 1,2,4,8,16,32 --qs 1" --bench-args "--steps 4 --groups 4 --group-size 8 --max-tokens 128" '
        "--json bench/results/simulator-rl-calibration-cpu.json", "docs/simulator-rl.md"),
    "verify-cost-cpu-k16.json": (
        "python bench/verify_cost.py --device cpu --threads 1 --mal 2.1,2.2 --ks 1,2,3,4,8,12,16 "
        "--json bench/results/verify-cost-cpu-k16.json --plot bench/results/verify-cost-cpu-k16.png",
        "docs/tuning.md, with the settings it records"),
    "verify-cost-h100-k24.json": (
        "python bench/verify_cost.py --model qwen3-8b --batches 1,2,4,8,16,32,64,128,256 --lengths "
        "1024,4096,8192,16384,32768 --ks 1,2,3,4,8,16,24 --warmup 4 --repeats 15 --budget-s 330 --mal 2.1,2.2 "
        "--json bench/results/verify-cost-h100-k24.json --plot bench/results/verify-cost-h100-k24.png",
        "bench/verify_cost.py's docstring, with the settings it records"),
    "verify-cost-h100.json": (
        "python bench/verify_cost.py --model qwen3-8b --budget-s 330 --mal 2.1,2.2 "
        "--json bench/results/verify-cost-h100.json --plot bench/results/verify-cost-h100.png",
        "bench/verify_cost.py's docstring"),
    "archive/verify-cost-cpu.json": (
        "python bench/verify_cost.py --device cpu --threads 1 --mal 2.1,2.2 "
        "--json bench/results/verify-cost-cpu.json --plot bench/results/verify-cost-cpu.png",
        "bench/verify_cost.py's docstring then"),
    "archive/areal-engines-cpu.json": (
        "python bench/areal_engines.py --json bench/results/archive/areal-engines-cpu.json", "docs/client.md"),
    "archive/draft-variants.json": (
        "python bench/draft_variants.py --traces $R/skyt1-ckpt-aime24.jsonl.gz,$R/r1distill-math-samples.jsonl.gz "
        '--tokenizer "$(samrollout model smollm2)" --json bench/results/archive/draft-variants.json',
        "docs/replay.md"),
    "archive/http-overhead-smollm2-cpu.json": (
        "python bench/http_overhead.py --model smollm2 --repeats 2 --json bench/results/http-overhead-smollm2-cpu.json "
        "--plot bench/results/http-overhead-smollm2-cpu.png", "bench/http_overhead.py's docstring, with the rounds "
        "it records"),
    "archive/projected-h100-static-2026-11-27.json": (
        "samrollout simulate --traces $R/skyt1-ckpt-aime24.jsonl.gz --tokenizer \"$(samrollout model smollm2)\" "
        "--cost bench/results/verify-cost-h100-k24.json --responses both --modes off,ngram,suffix,suffix-k16,"
        "samrollout,samrollout+fcfs,samrollout-p0.8,samrollout-p0.8+fcfs --slots 64,256 --instances 1,2 "
        "--kv-tokens 350000", "the first of the 4 runs its `commands` field records"),
    "archive/rollout-cost-cpu.json": (
        "python bench/rollout_cost.py --groups 64 --n 8 --json bench/results/rollout-cost-cpu.json",
        "bench/rollout_cost.py's docstring"),
    "archive/rollout-cost-sync-cpu.json": (
        "python bench/rollout_cost.py --temperatures 1.0 --modes off-sync,sam,off --json /tmp/rollout-cost-sync.json",
        _REBUILT),
    "archive/simulate-rl-runtime-sky-all-4x.json": (
        'samrollout simulate-rl --traces $R/skyt1-ckpt-aime24.jsonl.gz --tokenizer "$(samrollout model smollm2)" '
        "--responses all --instances 4 --slots 32 --train-ratio 0 --placements affine --cost "
        "bench/results/verify-cost-h100-k24.json --kv-tokens 350000 --epochs 2 --checkpoint-gb 16 --json "
        "bench/results/archive/simulate-rl-runtime-sky-all-4x.json", "docs/simulator-rl.md"),
    "archive/simulated-cpu-draft-range.json": (
        "samrollout simulate --traces $R/skyt1-ckpt-aime24.jsonl.gz,$R/r1distill-math-samples.jsonl.gz "
        '--tokenizer "$(samrollout model smollm2)" --cost bench/results/engine-cost-cpu.json --device-kind cpu '
        "--slots 32 --responses both --modes off,suffix,samrollout,samrollout-r32.3,samrollout-r16.3,"
        "samrollout-r32.3-c0,samrollout-r32.2 --json bench/results/simulated-cpu-draft-range.json", _REBUILT),
    "archive/weight-fanout-cpu.json": (
        "python bench/weight_fanout.py --servers 3 --link-mb-s 0,125 --repeats 3 --json "
        "bench/results/archive/weight-fanout-cpu.json --plot bench/results/archive/weight-fanout-cpu.png",
        "docs/rl-controls.md"),
    "archive/weight-push-cpu.json": (
        "python bench/weight_push.py --repeats 5 --json bench/results/archive/weight-push-cpu.json",
        "docs/rl-controls.md"),
    "archive/replay-smollm2.json": (
        f"samrollout replay --traces bench/data/smollm2-math-groups.jsonl.gz {_ORACLES} --json "
        "bench/results/archive/replay-smollm2.json --plot bench/results/archive/replay-smollm2.png", "docs/replay.md"),
    "archive/replay-smollm2-k3-every-round.json": (
        f"samrollout replay {_ORACLES} --k 3 --threshold off --long-context '' --json "
        "bench/results/replay-smollm2-k3-every-round.json --plot bench/results/replay-smollm2-k3-every-round.png",
        _REBUILT),
    "archive/replay-reasoning-traces.json": (
        f"{_REPLAY} {_ORACLES} --json bench/results/archive/replay-reasoning-traces.json --plot "
        "bench/results/archive/replay-reasoning-traces.png", "docs/replay.md"),
    "archive/replay-reasoning-traces-k3-every-round.json": (
        f"{_REPLAY} {_ORACLES} --k 3 --threshold off --long-context '' --json "
        "bench/results/replay-reasoning-traces-k3-every-round.json --plot "
        "bench/results/replay-reasoning-traces-k3-every-round.png", _REBUILT),
    "archive/replay-reasoning-traces-k16-scaled.json": (
        f"{_REPLAY} --drafters sam,sam-group,suffix-cache --k 16 --confident-match 0 --long-context '' "
        "--match-scale 1.0 --json bench/results/replay-reasoning-traces-k16-scaled.json --plot "
        "bench/results/replay-reasoning-traces-k16-scaled.png", _REBUILT),
    "archive/replay-confident0-k3.json": (f"{_CONFIDENT} --k 3 --confident-match 0 --json /tmp/exp/rc-0-k3.json",
                                          _REBUILT),
    "archive/replay-confident0-k8.json": (
        f"{_CONFIDENT} --k 8 --confident-match 0 --json bench/results/replay-confident0-k8.json --plot "
        "bench/results/replay-confident0-k8.png", _REBUILT),
    "archive/replay-confident8-k3.json": (f"{_CONFIDENT} --k 3 --confident-match 8 --json /tmp/exp/rc-8-k3.json",
                                          _REBUILT),
    "archive/replay-confident8-k8.json": (f"{_CONFIDENT} --k 8 --confident-match 8 --json /tmp/exp/rc-8-k8.json",
                                          _REBUILT),
    "archive/replay-confident16-k3.json": (f"{_CONFIDENT} --k 3 --confident-match 16 --json /tmp/exp/rc-16-k3.json",
                                           _REBUILT),
    "archive/replay-confident16-k8.json": (
        f"{_CONFIDENT} --k 8 --confident-match 16 --json bench/results/replay-confident16-k8.json --plot "
        "bench/results/replay-confident16-k8.png", _REBUILT),
    "archive/replay-global-k8.json": (
        f"{_HISTORY} --drafters sam-history,sam-global,suffix-cache --k 8 --confident-match 0 --json "
        "bench/results/replay-global-k8.json --plot bench/results/replay-global-k8.png", _REBUILT),
    "archive/replay-global-k16.json": (
        f"{_HISTORY} --drafters sam-history,sam-global,suffix-cache --k 16 --confident-match 0 --json "
        "bench/results/replay-global-k16.json --plot bench/results/replay-global-k16.png", _REBUILT),
    "archive/replay-history.json": (
        f"{_HISTORY} --drafters sam-group,sam-history,suffix-cache --confident-match 0 --json "
        "bench/results/replay-history.json --plot "
        "bench/results/replay-history.png", _REBUILT),
    "archive/replay-history-k8.json": (
        f"{_HISTORY} --drafters sam-group,sam-history,suffix-cache --k 8 --confident-match 0 --json "
        "bench/results/replay-history-k8.json --plot bench/results/replay-history-k8.png", _REBUILT),
    "archive/replay-k16-recent.json": (
        f"{_REPLAY} --history 2 --k 16 --confident-match 0 --oracle-sources '' --long-context '' --drafters "
        "sam-history,suffix-cache --occurrence recent --json bench/results/archive/replay-k16-recent.json",
        "docs/replay.md"),
    "archive/replay-k16-frequent.json": (
        f"{_REPLAY} --history 2 --k 16 --confident-match 0 --oracle-sources '' --long-context '' --drafters "
        "sam-history --occurrence frequent --json bench/results/archive/replay-k16-frequent.json", "docs/replay.md"),
    "archive/replay-k16-frequent-p01.json": (
        f"{_REPLAY} --history 2 --k 16 --confident-match 0 --oracle-sources '' --long-context '' --drafters "
        "sam-history --occurrence frequent --min-probability 0.1 --json "
        "bench/results/archive/replay-k16-frequent-p01.json", "docs/replay.md"),
    "archive/spec-engine-cpu.json": (
        f"{_SPEC} off,sam-static,sam-adaptive,sam-static-m1,ngram,suffix --repeats 3 --rollout 64 --json "
        "bench/results/spec-engine-cpu.json --plot bench/results/spec-engine-cpu.png", _REBUILT),
    "archive/spec-engine-cpu-nogroups.json": (
        f"{_SPEC} off,sam-static,sam-adaptive,sam-always,ngram,suffix --repeats 3 --rollout 64 --no-groups --json "
        "bench/results/spec-engine-cpu.json --plot bench/results/spec-engine-cpu.png",
        _REBUILT + " (from before group ids: --no-groups)"),
    "archive/spec-engine-cpu-policy.json": (
        f"{_SPEC} off,sam-static,sam-static-m2,suffix --batch-sizes 1,4 --repeats 3 --rollout 64 --json "
        "bench/results/spec-engine-cpu-policy.json", _REBUILT),
    "archive/spec-engine-cpu-batch64.json": (
        f"{_SPEC} off,sam-static --batch-sizes 64 --repeats 5 --rollout 8 --rollout-max 64 --json "
        "bench/results/spec-engine-cpu-batch64.json", _REBUILT),
    "archive/spec-engine-cpu-confident.json": (
        f"{_SPEC} off,sam-static,sam-confident-16,sam-confident-32,suffix --batch-sizes 64 --repeats 2 --rollout 64 "
        "--json bench/results/spec-engine-cpu-confident.json --plot bench/results/spec-engine-cpu-confident.png",
        _REBUILT),
    "archive/spec-engine-cpu-confident-history.json": (
        f"{_SPEC} off,sam-static,sam-confident-16,suffix --repeats 3 --rollout 64 --json "
        "/tmp/meas/spec-engine-join.json --plot /tmp/meas/spec-engine-join.png", _REBUILT),
    "archive/spec-engine-cpu-all-cores.json": (
        f"{_SPEC} off,sam-static,sam-confident-16,suffix --repeats 3 --rollout 64 --json "
        "bench/results/spec-engine-cpu-all-cores.json --plot bench/results/spec-engine-cpu-all-cores.png", _REBUILT),
    "archive/spec-engine-cpu-all-cores-adaptive.json": (
        f"{_SPEC} off,sam-adaptive,sam-always,suffix --repeats 2 --rollout 64 --json /tmp/exp/spec-adaptive.json",
        _REBUILT),
    "archive/spec-engine-cpu-all-cores-global.json": (
        f"{_SPEC} off,sam-static,sam-always-global,suffix --repeats 2 --rollout 64 --json "
        "bench/results/spec-engine-cpu-all-cores-global.json --plot "
        "bench/results/spec-engine-cpu-all-cores-global.png", _REBUILT),
    "archive/spec-engine-cpu-all-cores-steps.json": (
        f"{_SPEC} sam-static,sam-static-m1,suffix --rollout 64 --json /tmp/exp/spec-m1.json", _REBUILT),
    "archive/spec-engine-cpu-default.json": (
        f"{_SPEC} off,sam-static,sam-static-only,suffix --repeats 2 --rollout 64 --json /tmp/exp/spec-default.json "
        "--plot /tmp/exp/spec-default.png", _REBUILT),
    "archive/spec-engine-cpu-fp32.json": (
        f"{_SPEC} off,sam-default,sam-static,suffix --batch-sizes '' --repeats 3 --json "
        "bench/results/spec-engine-cpu-defaults.json --plot bench/results/spec-engine-cpu-defaults.png", _REBUILT),
    "archive/spec-engine-cpu-sampled.json": (
        f"{_SPEC} off,sam-static,suffix --batch-sizes '' --repeats 3 --temperature 1.0 --json "
        "bench/results/spec-engine-cpu-sampled.json --plot bench/results/spec-engine-cpu-sampled.png", _REBUILT),
}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def recorded(path: Path) -> dict[str, Any]:
    """The command and commit a JSON result records about itself, if any."""
    if path.suffix not in (".json", ".gz"):
        return {}
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {"command": data.get("command"), "commit": data.get("commit") or data.get("git_commit")}


def produced_by(path: Path) -> tuple[str, str]:
    """The last commit that wrote the file's content and its date: renames are followed and a pure one (a move to
    archive/) is passed over; ("uncommitted", "-") for a file git does not know yet."""
    relative = str(path.relative_to(ROOT))
    if path.is_dir():
        found = _git("log", "-1", "--format=%h %as", "--", relative)
        commit, _, date = found.partition(" ")
        return (commit, date) if commit else ("uncommitted", "-")
    commit = date = ""
    for line in _git("log", "--follow", "--format=commit %h %as", "--name-status", "--", relative).splitlines():
        if line.startswith("commit "):
            _, commit, date = line.split()
        elif line and not line.startswith("R100"):
            return commit, date
    return ("uncommitted", "-")


def plot_of(name: str) -> str | None:
    """The JSON a plot belongs to: `PLOTS`, else the JSON of the same name; None for what is not a plot."""
    if not name.endswith(".png"):
        return None
    return PLOTS.get(Path(name).name, Path(name).with_suffix(".json").name)


def command(relative: str, path: Path) -> str:
    """The command that wrote the file, in backticks, and where it comes from when the file does not record it."""
    owner = plot_of(relative)
    if owner is not None:
        return f"as `{owner}`"
    if recorded(path).get("command"):
        return f"`{recorded(path)['command']}`"
    if relative in KNOWN_COMMANDS:
        known, source = KNOWN_COMMANDS[relative]
        return f"`{known}` ({source})"
    return "-"


def row(path: Path, what: str, pages: dict[str, str]) -> str:
    """One table row: the file, what it shows, the pages citing it, its commit and date, its command."""
    relative = str(path.relative_to(RESULTS))
    commit, date = produced_by(path)
    commit = recorded(path).get("commit") or commit
    cited = ", ".join(name for name, text in pages.items() if path.name in text) or "-"
    return f"| `{relative}` | {what} | {cited} | {commit[:12]} | {date} | {command(relative, path)} |"


def described(path: Path, descriptions: dict[str, str]) -> str | None:
    """What the file shows: its entry in ``descriptions``, or for a plot, that it is its JSON's plot."""
    owner = plot_of(path.name)
    if owner is not None and owner in descriptions and (path.parent / owner).exists():
        return f"the plot of `{owner}`"
    return descriptions.get(path.name)


def table(folder: Path, descriptions: dict[str, str], pages: dict[str, str]) -> tuple[list[str], list[str]]:
    """The rows of every file in ``folder`` (archive/ aside) and the names of those nothing describes."""
    files = sorted(p for p in folder.iterdir() if p.name not in ("README.md", "archive"))
    rows, unknown = [], []
    for path in files:
        what = described(path, descriptions)
        if what is None:
            unknown.append(str(path.relative_to(RESULTS)))
        else:
            rows.append(row(path, what, pages))
    return rows, unknown


def main() -> None:
    """Write the index; stop, naming them, if some files are not described."""
    pages = {str(page.relative_to(ROOT)): page.read_text() for page in PAGES if page.exists()}
    current, unknown = table(RESULTS, CURRENT, pages)
    superseded, unknown_archived = table(ARCHIVE, SUPERSEDED, pages) if ARCHIVE.is_dir() else ([], [])
    if unknown or unknown_archived:
        sys.exit("not described in bench/results_index.py (CURRENT or SUPERSEDED): "
                 + ", ".join(unknown + unknown_archived))
    header = ["| file | what it shows | cited in | commit | date | command |", "| --- | --- | --- | --- | --- | --- |"]
    lines = ["# Benchmark results", "",
             "Written by `python bench/results_index.py`; do not edit by hand. Each file comes from a `bench/` script "
             "or the `samrollout` CLI. **commit**: the one the file records, else the last commit that changed the "
             "file's content (the code that produced it); **command**: the one the file records, else the one "
             "`results_index.py` found (in the docs, a script's docstring, the commit) or rebuilt from the options the "
             "file records, with where it comes from; a plot (PNG) is written by its JSON's command. `$R` is "
             "`../shared/data/reasoning-traces`, long reasoning traces outside this repository. **cited in**: the "
             "pages that name the file. Figures are only comparable within one file (one run, one machine, one day): "
             "the docs quote each with its file.", "",
             "## Current", "", "What the docs' current claims rest on.", "", *header, *current, "",
             "## Superseded", "",
             "`archive/`: earlier measurements that the current code no longer reproduces (older defaults, older "
             "simulator versions, runs repeated since), kept as the record the docs' history sections cite.", "",
             *header, *superseded]
    (RESULTS / "README.md").write_text("\n".join(lines) + "\n")
    print(f"indexed {len(current)} current files and {len(superseded)} superseded")


if __name__ == "__main__":
    main()
