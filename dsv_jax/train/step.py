"""The train state and the jitted train step (one compiled program per bucket shape)."""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsv_jax.config import Config
from dsv_jax.model.t2v import TextToVideo
from dsv_jax.parallel.mesh import state_shardings
from dsv_jax.train.loss import fixed_t_loss, flow_matching_loss
from dsv_jax.train.optimizer import (
    keep_model,
    keep_predictor,
    make_train_optimizer,
    param_labels,
    scale_updates,
)


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 []
    params: Any  # nnx.State of TextToVideo's parameters (fp32 master weights)
    opt_state: Any
    rng: jax.Array  # uint32 key data; step keys are fold_in(rng, step), so resuming replays them
    skipped: jax.Array  # int32 []: updates skipped for a non-finite loss or gradient
    # The EMA of `params` (train.ema_decay > 0; the weights sampling and evaluation use), or None: without
    # an EMA the state holds no second copy of the weights.
    ema: Any = None


def abstract_model(cfg: Config):
    """(graphdef, abstract params) without allocating anything."""
    model = nnx.eval_shape(lambda: TextToVideo(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(model, nnx.Param)


def init_state(cfg: Config) -> TrainState:
    model = TextToVideo(cfg, rngs=nnx.Rngs(cfg.train.seed))
    _, params = nnx.split(model, nnx.Param)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=make_train_optimizer(cfg).init(params),
        rng=jax.random.key_data(jax.random.key(cfg.train.seed + 1)),
        skipped=jnp.zeros((), jnp.int32),
        ema=init_ema(cfg, params),
    )


def init_ema(cfg: Config, params):
    """The EMA a run starts with (a copy of `params`), or None when train.ema_decay is 0."""
    return jax.tree.map(jnp.copy, params) if cfg.train.ema_decay > 0 else None


def ema_decay_at(train_cfg, step) -> jax.Array:
    """The EMA's decay at the update made by step `step` (0-based): train.ema_decay, or with ema_warmup
    min(ema_decay, (1 + step) / (10 + step)): 0.1 at the first update, 0.9 at step 80, 0.99 at step 890,
    so a run shorter than the decay's horizon 1 / (1 - ema_decay) still forgets its random init."""
    decay = jnp.float32(train_cfg.ema_decay)
    if train_cfg.ema_warmup:
        n = jnp.asarray(step, jnp.float32)
        decay = jnp.minimum(decay, (1 + n) / (10 + n))
    return decay


def update_ema(ema, params, decay):
    return jax.tree.map(lambda e, p: (decay * e + (1 - decay) * p).astype(e.dtype), ema, params)


def ema_layout(abstract_state: TrainState, has_ema: bool) -> TrainState:
    """`abstract_state` with an EMA shaped and sharded like its params, or without one: the layout of a
    checkpoint saved with or without an EMA, whatever the resuming config asks."""
    return abstract_state.replace(ema=abstract_state.params if has_ema else None)


def state_layout(cfg: Config, mesh) -> tuple[Any, Any]:
    """(abstract state, shardings) of cfg's train state on `mesh`, nothing allocated. The abstract state
    (ShapeDtypeStructs that carry the shardings) is what steps are lowered against and checkpoints
    restore into."""
    abstract = jax.eval_shape(lambda: init_state(cfg))
    sharding = state_shardings(abstract, mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, sharding), sharding


def create_state(cfg: Config, sharding) -> TrainState:
    """A fresh train state, built inside jit straight into its shardings (never whole on one device)."""
    return jax.jit(lambda: init_state(cfg), out_shardings=sharding)()


def _norm(tree, labels=None, want="main"):
    leaves = (
        jax.tree.leaves(tree)
        if labels is None
        else [g for g, lab in zip(jax.tree.leaves(tree), jax.tree.leaves(labels)) if lab == want]
    )
    return jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in leaves)) if leaves else jnp.zeros(())


def predictor_value_and_grad(loss_fn, params):
    """((value, aux), grads) of `loss_fn` (with aux) differentiated in the DSV predictor's parameters alone,
    zeros for every other parameter: those enter as constants, so the model's backward pass is never built
    (dsv.freeze_model_stage1; the predictor's inputs are stop-gradient, so its loss reaches only itself)."""
    leaves, treedef = jax.tree.flatten(params)
    mine = [i for i, lab in enumerate(jax.tree.leaves(param_labels(params))) if lab == "predictor"]

    def of_predictor(predictor):
        full = list(leaves)
        for i, leaf in zip(mine, predictor):
            full[i] = leaf
        return loss_fn(jax.tree.unflatten(treedef, full))

    out, grads = jax.value_and_grad(of_predictor, has_aux=True)([leaves[i] for i in mine])
    full = [jnp.zeros_like(leaf) for leaf in leaves]
    for i, g in zip(mine, grads):
        full[i] = g
    return out, jax.tree.unflatten(treedef, full)


def make_train_step(cfg: Config, graphdef, attention="auto"):
    """(state, batch, lr[, attention_inputs]) -> (state, metrics). A step whose loss or gradient is not
    finite leaves the parameters and optimizer state untouched and counts itself in `skipped`.

    `attention`: a backend name or per-block plans (static). `attention_inputs` (DSV, runtime):
    {"keep": [depth, H] per-head keep ratios, "predictor_lr": []}. Under DSV the predictor loss of every
    block is added to the objective; its gradient reaches only the predictors (stop-gradient inputs),
    which `make_train_optimizer` updates with their own AdamW at `predictor_lr`."""
    tx = make_train_optimizer(cfg)
    plans = attention if isinstance(attention, (list, tuple)) else (attention,)
    # a step whose plans all skip the predictor loss (stage 2 between predictor steps, or a non-DSV
    # attention on a model with predictors) leaves the predictor and its optimizer state as they are
    freeze_predictor = bool(cfg.predictor_rank) and not any(getattr(p, "predictor", False) for p in plans)
    # DSV stage 1 under dsv.freeze_model_stage1: the predictor alone trains; the model, its AdamW state and
    # its EMA stay bitwise as they were
    freeze_model = bool(cfg.predictor_rank) and any(getattr(p, "model_frozen", False) for p in plans)

    def train_step(state: TrainState, batch, lr, attention_inputs=None):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        inputs = attention_inputs or {}
        block_inputs = {k: v for k, v in inputs.items() if k != "predictor_lr"} or None

        def loss_fn(params):
            loss, aux = flow_matching_loss(
                nnx.merge(graphdef, params), batch, key, cfg.train, attention, block_inputs, return_aux=True
            )
            total = loss + jnp.sum(aux["predictor_loss"]) if "predictor_loss" in aux else loss
            return total, (loss, aux)

        if freeze_model:
            (_, (loss, aux)), grads = predictor_value_and_grad(loss_fn, state.params)
        else:
            (_, (loss, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        labels = param_labels(grads) if cfg.predictor_rank else None
        grad_norm = _norm(grads, labels)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        predictor_lr = inputs.get("predictor_lr", cfg.dsv.predictor_lr) if cfg.predictor_rank else None
        params = optax.apply_updates(state.params, scale_updates(updates, lr, predictor_lr))
        if freeze_predictor:
            params, opt_state = keep_predictor(params, opt_state, state.params, state.opt_state)
        if freeze_model:
            params, opt_state = keep_model(params, opt_state, state.params, state.opt_state)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if "predictor_loss" in aux:
            finite &= jnp.all(jnp.isfinite(aux["predictor_loss"])) & jnp.isfinite(_norm(grads, labels, "predictor"))
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_params = keep(params, state.params)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "finite": finite}
        ema = state.ema
        if ema is not None:  # a skipped step leaves the EMA as it was, too
            decay = ema_decay_at(cfg.train, state.step)
            updated = update_ema(ema, new_params, decay)
            if freeze_model:  # d e + (1 - d) p is not bitwise e where p == e: the frozen leaves keep theirs
                updated = jax.tree.map(
                    lambda u, e, lab: u if lab == "predictor" else e, updated, ema, param_labels(ema)
                )
            ema = keep(updated, ema)
            metrics["ema_decay"] = decay
        new_state = state.replace(
            step=state.step + 1,
            params=new_params,
            opt_state=keep(opt_state, state.opt_state),
            skipped=state.skipped + (~finite).astype(jnp.int32),
            ema=ema,
        )
        # per block: [depth] or [depth, H]; DSV's outputs under dsv/, context-parallel exchange stats under cp/
        metrics.update({(k if k.startswith("cp/") else f"dsv/{k}"): v for k, v in aux.items()})
        return new_state, metrics

    return train_step


EVAL_T = (0.1, 0.3, 0.5, 0.7, 0.9)


def make_eval_step(cfg: Config, graphdef, attention="auto"):
    """(params, batch, key[, attention_inputs]) -> loss at each of EVAL_T, with noise fixed by `key`."""

    def eval_step(params, batch, key, attention_inputs=None):
        block_inputs = {k: v for k, v in (attention_inputs or {}).items() if k != "predictor_lr"} or None
        return fixed_t_loss(nnx.merge(graphdef, params), batch, key, EVAL_T, attention, block_inputs)

    return eval_step
