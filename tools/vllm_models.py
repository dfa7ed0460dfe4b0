"""Small vLLM-loadable models built offline: random weights, a locally trained tokenizer.

Who calls it: ``tests/engine_plugin/vllm`` and ``tools/bench_vllm.py``. Nothing is downloaded: a
transformers config is instantiated with random weights (normal, ``init_std``, large
enough that greedy decoding does not collapse to one repeated token) and saved with
``save_pretrained``; the tokenizer is a byte-level BPE trained by ``tokenizers`` on a
generated corpus. ``vllm.LLM(model=<folder>)`` then loads the folder offline.

Two shapes (``MODEL_KINDS``):

* ``plain``: Llama-style, every layer full attention.
* ``hybrid``: Gemma3-style, sliding-window and full-attention layers alternating
  (``layer_types`` explicit: Gemma3 makes every layer sliding otherwise), with a
  window much shorter than the test prompts.

Head sizes are ones vLLM's CPU attention accepts (32, 64, 80, ...). Gemma needs tied
embeddings (vLLM has no ``lm_head`` for it otherwise).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

VOCAB = 512


@dataclass(frozen=True, slots=True)
class ModelSpec:
    kind: str = "plain"  # a key of MODEL_KINDS
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 256
    sliding_window: int = 64  # hybrid only
    max_positions: int = 32768
    init_std: float = 0.08
    seed: int = 0


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
             for _ in range(600)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(n_lines)]


def _save_tokenizer(out: Path, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<bos>", "<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(2000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>")
    fast.save_pretrained(out)


def _plain_config(spec: ModelSpec):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                       num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                       num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
                       max_position_embeddings=spec.max_positions, bos_token_id=0, eos_token_id=1,
                       pad_token_id=2, tie_word_embeddings=False, initializer_range=spec.init_std,
                       torch_dtype="bfloat16")


def _hybrid_config(spec: ModelSpec):
    from transformers import Gemma3TextConfig

    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.layers)]
    return Gemma3TextConfig(vocab_size=VOCAB, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                            num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                            num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
                            sliding_window=spec.sliding_window, layer_types=layer_types,
                            max_position_embeddings=spec.max_positions, bos_token_id=0, eos_token_id=1,
                            pad_token_id=2, tie_word_embeddings=True, initializer_range=spec.init_std,
                            torch_dtype="bfloat16")


MODEL_KINDS = {"plain": ("LlamaForCausalLM", _plain_config), "hybrid": ("Gemma3ForCausalLM", _hybrid_config)}


def build_model(out: str | Path, spec: ModelSpec = ModelSpec()) -> Path:
    """Write a loadable model folder for ``spec`` at ``out`` (reused when it already holds
    one built from the same spec) and return its path."""
    import torch
    import transformers

    out = Path(out)
    marker = out / "kvstack_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return out
    if spec.kind not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {spec.kind!r}; known: {sorted(MODEL_KINDS)}")
    arch, make_config = MODEL_KINDS[spec.kind]
    config = make_config(spec)
    torch.manual_seed(spec.seed)
    model = getattr(transformers, arch)(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, spec.init_std)
    model.to(torch.bfloat16).save_pretrained(out)
    _save_tokenizer(out, spec.seed)
    marker.write_text(json.dumps(asdict(spec)))
    return out


def prompt_ids(n_tokens: int, seed: int, prefix: list[int] | None = None) -> list[int]:
    """``n_tokens`` token ids (a shared ``prefix`` first, then seeded random ids past the
    special tokens)."""
    rng = random.Random(seed)
    head = list(prefix or [])[:n_tokens]
    return head + [rng.randrange(3, VOCAB) for _ in range(n_tokens - len(head))]
