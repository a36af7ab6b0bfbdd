"""Build a tiny random Llama and a byte-level BPE tokenizer in a folder, offline.

    build_tiny_llama(folder, layers=2, hidden=128, heads=4, kv_heads=2, seed=0,
                     head_dim=None)
    build_shaped_llama(folder, shape, hidden, max_positions)  the same, with the
                     layers, KV heads (as many query heads) and head size of a
                     ``kvpool.demo.shapes.ModelShape``
    build_tiny_gemma3(folder, layers=4, window=64, seed=0)  a random Gemma-3
                     text model: sliding-window layers with a full-attention
                     layer every ``full_every`` (a hybrid model for vLLM's
                     hybrid KV cache manager)

vLLM's CPU attention needs head size >= 32 (``head_dim``, by default hidden /
heads); an explicit ``head_dim`` gives a real model's KV shape with a tiny
hidden size (``kvpool.demo.shapes``). Weights are random
(seeded), so outputs are meaningless but deterministic: good for comparing a
run with the pool against one without. Needs ``transformers`` and
``tokenizers`` (both come with vLLM).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.demo.shapes import ModelShape

__all__ = ["build_shaped_llama", "build_tiny_gemma3", "build_tiny_llama"]

_CORPUS = [
    f"the quick brown fox jumps over the lazy dog number {i} and the cat sat on mat {7 * i} " * 3
    for i in range(2000)
]


def build_tiny_llama(
    folder: str | Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    max_positions: int = 4096,
    seed: int = 0,
    head_dim: int | None = None,
) -> Path:
    """Write the model and tokenizer into ``folder`` (reused if already built alike)."""
    folder = Path(folder)
    spec = {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "intermediate": intermediate,
        "max_positions": max_positions,
        "seed": seed,
        "head_dim": head_dim,
    }
    if (head_dim or hidden // heads) < 32:
        raise ValueError(
            "vLLM's CPU attention needs a head size (head_dim or hidden / heads) >= 32"
        )

    def make(tok: Any) -> Any:
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=max(1024, len(tok)),
                hidden_size=hidden,
                intermediate_size=intermediate,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                max_position_embeddings=max_positions,
                **({"head_dim": head_dim} if head_dim else {}),
                tie_word_embeddings=False,
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        )

    return _save_once(folder, spec, make)


def _save_once(folder: Path, spec: dict[str, Any], make: Callable[[Any], Any]) -> Path:
    """Write the tokenizer and the random model ``make(tokenizer)`` (weights drawn
    after seeding torch with ``spec["seed"]``) into ``folder``, stamped with
    ``spec``; a folder already stamped alike is reused as it is."""
    stamp = folder / "kvpool-tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return folder
    import torch

    tok = _write_tokenizer(folder)
    torch.manual_seed(spec["seed"])
    make(tok).save_pretrained(folder)
    stamp.write_text(json.dumps(spec))
    return folder


def _write_tokenizer(folder: Path) -> Any:
    """A byte-level BPE tokenizer trained on a fixed corpus, saved in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        _CORPUS,
        trainers.BpeTrainer(
            vocab_size=1000,
            special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tok.save_pretrained(folder)
    return tok


def build_tiny_gemma3(
    folder: str | Path,
    *,
    layers: int = 4,
    full_every: int = 4,
    window: int = 64,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    seed: int = 0,
) -> Path:
    """Write a random Gemma-3 text model (sliding-window layers, every
    ``full_every``-th one full attention) and the tokenizer into ``folder``."""
    folder = Path(folder)
    spec = {"arch": "gemma3", "layers": layers, "full_every": full_every, "window": window,
            "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "seed": seed}  # fmt: skip
    kinds = [
        "full_attention" if (i + 1) % full_every == 0 else "sliding_attention"
        for i in range(layers)
    ]

    def make(tok: Any) -> Any:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        return Gemma3ForCausalLM(
            Gemma3TextConfig(
                vocab_size=max(1024, len(tok)),
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                sliding_window=window,
                layer_types=kinds,
                max_position_embeddings=4096,
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        )

    return _save_once(folder, spec, make)


def build_tiny_granite_hybrid(
    folder: str | Path,
    *,
    layers: int = 4,
    attention_every: int = 4,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    mamba_heads: int = 8,
    mamba_d_state: int = 16,
    seed: int = 0,
) -> Path:
    """Write a random Granite-4-style hybrid (``GraniteMoeHybridForCausalLM``, no
    experts): Mamba-2 layers, every ``attention_every``-th one attention, and the
    tokenizer into ``folder``. A Mamba layer's state: ``mamba_heads`` heads of
    ``2 * hidden / mamba_heads`` channels by ``mamba_d_state`` (Granite-4.0-H-Tiny:
    hidden 1536, 48 heads, state 128)."""
    folder = Path(folder)
    spec = {"arch": "granitemoehybrid", "layers": layers, "attention_every": attention_every,
            "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "seed": seed,
            **({"mamba_heads": mamba_heads, "mamba_d_state": mamba_d_state}
               if (mamba_heads, mamba_d_state) != (8, 16) else {})}  # fmt: skip
    kinds = ["attention" if (i + 1) % attention_every == 0 else "mamba" for i in range(layers)]

    def make(tok: Any) -> Any:
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        return GraniteMoeHybridForCausalLM(
            GraniteMoeHybridConfig(
                vocab_size=max(1024, len(tok)),
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                shared_intermediate_size=2 * hidden,
                num_local_experts=0,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                layer_types=kinds,
                mamba_n_heads=mamba_heads,
                mamba_n_groups=1,
                mamba_d_state=mamba_d_state,
                mamba_d_head=hidden * 2 // mamba_heads,
                mamba_d_conv=4,
                mamba_expand=2,
                position_embedding_type="rope",
                max_position_embeddings=4096,
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        )

    return _save_once(folder, spec, make)


def build_shaped_llama(
    folder: str | Path,
    shape: ModelShape,
    hidden: int,
    max_positions: int,
    intermediate: int = 256,
) -> Path:
    """``build_tiny_llama`` with ``shape``'s KV: its layers, KV heads (as many query
    heads) and head size, whatever the hidden (and MLP) size."""
    return build_tiny_llama(
        folder,
        layers=shape.layers,
        hidden=hidden,
        intermediate=intermediate,
        heads=shape.kv_heads,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_positions=max_positions,
    )
