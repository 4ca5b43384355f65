"""Parameter count of the model a config trains, from the config alone (no jax: `dsv-jax presets` lists
every preset in well under a second).

The sum follows the modules' constructors (dit.py, layers.py, text.py, dsv/predictor.py); a test holds it
to the count of the model itself (flax's eval_shape) for every preset and the options that change it.
"""

from __future__ import annotations

from dsv_jax.config import Config
from dsv_jax.data.text import vocab_size


def _linear(din: int, dout: int, bias: bool = True) -> int:
    return din * dout + (dout if bias else 0)


def parameter_count(cfg: Config) -> int:
    """Parameters of TextToVideo for `cfg`: the DiT or MMDiT, its DSV predictors (attention=dsv) and the
    built-in text encoder (text.encoder=builtin)."""
    m = cfg.model
    d, mmdit = m.hidden, m.arch == "mmdit"

    def modulation(n: int) -> int:  # AdaLN-Zero per block, or adaLN-single's per-block table
        return _linear(d, n * d) if m.adaln == "per_block" else n * d

    def qkv(kv_from: int | None = None) -> int:
        norms = 2 * (d if m.qk_norm_scope == "all_heads" else m.head_dim) if m.qk_norm else 0  # q, k RMSNorm scales
        projections = _linear(d, d) + _linear(kv_from, 2 * d) if kv_from is not None else _linear(d, 3 * d)
        return projections + norms

    def mlp(width: int) -> int:
        return _linear(d, width) + _linear(width, d)

    predictor = 2 * _linear(d, m.heads * cfg.predictor_rank, bias=False)  # W_Q^lr, W_K^lr
    if mmdit:
        text_mlp = mlp(m.text_mlp_hidden)
        block = 2 * (modulation(6) + qkv() + _linear(d, d)) + mlp(m.mlp_hidden) + text_mlp
    else:
        block = modulation(6) + qkv() + _linear(d, d) + qkv(kv_from=d) + _linear(d, d) + mlp(m.mlp_hidden)
        block += 2 * d if m.cross_norm == "affine" else 0
    total = (
        _linear(m.patch_dim, d)  # patch embedding
        + _linear(256, d)
        + _linear(d, d)  # timestep MLP
        + _linear(m.text_dim, d)
        + _linear(d, d)  # text projection
        + (_linear(d, d) if mmdit else 0)  # pooled text
        + (_linear(d, m.shared_modulation_rows * d) if m.adaln == "single" else 0)
        + m.depth * (block + predictor)
        + modulation(2)
        + _linear(d, m.patch_dim)  # final layer
    )
    if cfg.text.encoder == "builtin":  # token and position embeddings, LayerNorm scale and bias
        total += vocab_size(cfg.text.hash_buckets) * m.text_dim + cfg.text.max_len * m.text_dim + 2 * m.text_dim
    return int(total)
