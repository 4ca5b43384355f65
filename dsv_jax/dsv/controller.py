"""The two-stage DSV controller (host side): when to go sparse, and which blocks.

    stage 1  full attention everywhere; every block's predictor learns; sparsity is profiled
    stage 2  from the step where the predictor loss averaged over blocks falls below dsv.switch_loss
             (an EMA over profile steps), or after dsv.stage1_steps steps: a block attends sparsely
             where 1 - the mean of its heads' keep ratios (below) is at least dsv.threshold (the
             cost-benefit switch); the predictor keeps training at a lower rate: lr
             dsv.predictor_lr * dsv.stage2_lr_scale, its loss on at most dsv.stage2_max_queries
             sampled queries on the steps that do not profile, and only on every
             dsv.stage2_predictor_every-th step (and every profile step) at that many times the rate

With dsv.freeze_model_stage1 the stage-1 plans carry `model_frozen`: their steps train the predictors alone
(retrofitting DSV onto pretrained weights; the train step reads the flag).

Sparsity depends on the sequence length, so statistics and decisions are kept per bucket shape. A
profile runs every dsv.profile_every steps and on the first step of each shape. Per block and head the
profiled sparsity (a low percentile over sampled queries) is smoothed by an EMA; the per-head keep
ratio (below) is a runtime input of the step, while the block's static
top_k is the smallest rung of dsv.ladder that holds its largest head keep ratio. Moving to a sparser
rung, or from sparse back to dense, needs a margin (dsv.hysteresis), so decisions, and with them the
compiled variants (cached by the trainer, keyed by (shape, plans)), change rarely.

Per-head keep ratios come from one of two rules. The paper's: min(1, dsv.keep_scale * (1 - sparsity)),
theta bounding the mass of the exact top keys. With dsv.recall_target > 0 (our addition), from the
measured recall curve instead: on every profile step the profiler measures, per block and head, the
attention mass that the predictor's best-scoring fraction f of the KV blocks holds (profiler.RECALL_FRACTIONS);
the curve is smoothed by the same EMA, and a head keeps the smallest f whose recall reaches the target
(the paper's rule until the block has a curve).
That is what the goal asks of a selection (its recall), measured on the selection the kernel would run
(tile proxy, block scores), so the keep ratios of stage 2 are calibrated while stage 1 runs; the
threshold then compares the sparsity at the target recall, 1 - mean keep, with the kernel's break-even.

Back-off (dsv.backoff_max_every; ours): DSV's own work, the predictor's loss and the profiles, is all it
adds to a step whose blocks are all dense, so in stage 2 each profile that leaves every block of a bucket
dense doubles that bucket's intervals between profiles (dsv.profile_every) and between predictor steps
(dsv.stage2_predictor_every), until profiles are dsv.backoff_max_every steps apart; a profile that makes a
block sparse restores both at once. Backed-off profiles stay on the dsv.profile_every grid (the first grid
step at least the interval after the bucket's last profile); predictor steps are the multiples of their
interval. The predictor's per-step learning rate is unchanged: while nothing is sparse it fine-tunes more
slowly, and the profiles, which train it on dsv.max_queries rows, still tell when sparsity emerges. A step
that neither profiles nor trains the predictor runs the program of full attention (the predictor and its
AdamW state pass through untouched). The controller counts the steps that trained the predictor and that
profiled (`record`, per stage) for the end-of-run summary (`run_summary`).

All decisions depend only on the step number and the profiled metrics, and the whole state is JSON
(checkpointed with the run), so a resumed run makes the same decisions as an uninterrupted one.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from dsv_jax.dsv.plan import AttentionPlan
from dsv_jax.dsv.profiler import RECALL_FRACTIONS, keep_for_recall

log = logging.getLogger("dsv_jax")


def shape_key(shape) -> str:
    return "x".join(str(int(v)) for v in shape)


class DSVController:
    def __init__(self, cfg, state: dict | None = None):
        if cfg.attention != "dsv":
            raise ValueError(f"the DSV controller needs attention=dsv, got attention={cfg.attention!r}")
        self.cfg, self.dsv = cfg, cfg.dsv
        self.depth, self.heads = cfg.model.depth, cfg.model.heads
        self.stage, self.switch_step, self.loss_ema = 1, None, None
        # shape key -> {"sparsity": [depth][H] EMA, "recall_curve": [depth] of None or [H][F] EMA,
        #               "rungs": [depth], "profiles": n, "backoff": back-off level (intervals x 2**level),
        #               "last_profile": step or None, "sparse_since": step or None (some block sparse)}
        self.shapes: dict[str, dict[str, Any]] = {}
        # training steps per stage: all, those that trained the predictor, those that profiled (`record`)
        self.counts = {stage: dict.fromkeys(COUNTS, 0) for stage in STAGES}
        self.first_sparse_step: int | None = None  # the first step a block attended sparsely
        self.backoff_every = 0  # the longest interval between profiles a step ran with (back-off; `record`)
        # The selection measured for recall while a block is dense: the rung at the threshold.
        self.prospective = self.rung_for(1.0 - self.dsv.threshold) or self.dsv.ladder[-1]
        if state:
            self.load_state_dict(state)

    # -- what the next step runs ----------------------------------------------------------------
    def profile_due(self, step: int, shape) -> bool:
        """Whether training step `step` on `shape` profiles: the bucket's first step, then steps on the
        dsv.profile_every grid at least the bucket's profile interval (see `intervals`) after its last profile."""
        entry = self.shapes.get(shape_key(shape))
        if entry is None:
            return True
        if step % self.dsv.profile_every:
            return False
        every, last = self.intervals(shape)[0], entry["last_profile"]
        return every <= self.dsv.profile_every or last is None or step - last >= every

    def trains_predictor(self, step: int | None, profile: bool = False, shape=None) -> bool:
        """Whether training step `step` (None: any) on `shape` computes the predictor loss and updates the
        predictor: every stage-1 step; in stage 2 profile steps and the multiples of the predictor interval."""
        if self.stage == 1 or profile or step is None:
            return True
        every = self.intervals(shape)[1] if shape is not None else self.dsv.stage2_predictor_every
        return every == 1 or step % every == 0

    @property
    def max_backoff(self) -> int:
        """The back-off level at which profiles are dsv.backoff_max_every steps apart (0: no back-off)."""
        d, level = self.dsv, 0
        while d.profile_every << level < d.backoff_max_every:
            level += 1
        return level

    def intervals(self, shape) -> tuple[int, int]:
        """(steps between profiles, steps between stage-2 predictor steps) of a bucket: dsv.profile_every and
        dsv.stage2_predictor_every, both doubled per back-off level, capped at dsv.backoff_max_every."""
        d = self.dsv
        entry = self.shapes.get(shape_key(shape))
        level = min(entry["backoff"], self.max_backoff) if entry else 0
        if not level:
            return d.profile_every, d.stage2_predictor_every
        cap = d.backoff_max_every
        predictor = min(d.stage2_predictor_every << level, max(cap, d.stage2_predictor_every))
        return min(d.profile_every << level, cap), predictor

    def plans(
        self, shape, *, train: bool = True, profile: bool = False, step: int | None = None
    ) -> tuple[AttentionPlan, ...]:
        """Static per-block plans of a step on `shape`: train adds the predictor loss (on the steps that
        train it, see `trains_predictor`), profile the sparsity statistics (see `profile_due`); neither for
        evaluation and sampling."""
        d = self.dsv
        profile = train and profile
        predictor = train and self.trains_predictor(step, profile, shape)
        lower_rate = self.stage == 2 and train and not profile and d.stage2_max_queries
        queries = min(d.stage2_max_queries, d.max_queries) if lower_rate else d.max_queries
        frozen = train and self.stage == 1 and d.freeze_model_stage1
        out = []
        for rung in self.rungs(shape):
            sparse = self.stage == 2 and rung > 0
            keep = rung if sparse else (self.prospective if profile else 0.0)
            out.append(
                AttentionPlan(
                    mode="dsv",
                    backend=d.dense_backend,
                    sparse=sparse,
                    keep=keep,
                    kv_block=d.kv_block,
                    predictor=predictor,
                    profile=profile,
                    block_reduce=d.block_reduce,
                    center_logits=d.center_logits,
                    query_stride=d.query_stride,
                    max_queries=queries,
                    theta=d.theta,
                    percentile=d.percentile,
                    model_frozen=frozen,
                )
            )
        return tuple(out)

    def inputs(self, shape, *, train: bool = True, step: int | None = None) -> dict[str, np.ndarray]:
        """Runtime inputs: per-head keep ratios [depth, H] and, in training, the predictor's learning rate
        (in stage 2 times dsv.stage2_predictor_every: it trains on that share of the steps; a step that
        does not train it ignores the rate)."""
        keep = {"keep": self.keep(shape).astype(np.float32)}
        if not train:
            return keep
        d = self.dsv
        lr = d.predictor_lr * (d.stage2_lr_scale * d.stage2_predictor_every if self.stage == 2 else 1.0)
        return {**keep, "predictor_lr": np.float32(lr)}

    def keep(self, shape) -> np.ndarray:
        entry = self.shapes.get(shape_key(shape))
        if entry is None:
            return np.ones((self.depth, self.heads))
        return self._keep(entry)

    def _keep(self, entry) -> np.ndarray:
        """Per-head keep ratios [depth, H] of a shape's statistics (see the module docstring)."""
        d = self.dsv
        keep = np.minimum(1.0, d.keep_scale * (1.0 - np.asarray(entry["sparsity"], np.float64)))
        if d.recall_target:
            for i, curve in enumerate(entry["recall_curve"]):
                if curve is not None:
                    keep[i] = keep_for_recall(curve, d.recall_target)
        return keep

    def rungs(self, shape) -> list[float]:
        entry = self.shapes.get(shape_key(shape))
        return list(entry["rungs"]) if entry else [0.0] * self.depth

    # -- decisions --------------------------------------------------------------------------------
    def rung_for(self, keep: float) -> float:
        """The smallest ladder rung >= keep, or 0.0 (dense) where none is."""
        return next((float(r) for r in self.dsv.ladder if r >= keep - 1e-9), 0.0)

    def decide(self, keep_heads: np.ndarray, current: float) -> float:
        """A block's rung (0.0: dense) from its heads' keep ratios and its current rung."""
        d = self.dsv
        threshold = d.threshold - (d.hysteresis if current > 0 else 0.0)
        if 1.0 - float(np.mean(keep_heads)) < threshold:
            return 0.0
        need = float(np.max(keep_heads))
        rung = self.rung_for(need)
        if 0 < rung < current and need > rung * (1.0 - d.hysteresis):
            # not clearly inside the smaller rung: stop one rung above it (never above the current one)
            above = [float(r) for r in d.ladder if r > rung]
            rung = min(above[0], current) if above else current
        return rung

    def before_step(self, step: int) -> list[str]:
        """Called before step `step` runs; switches to stage 2 after dsv.stage1_steps steps."""
        if self.stage == 1 and self.dsv.stage1_steps and step >= self.dsv.stage1_steps:
            return self._switch(step, f"after {self.dsv.stage1_steps} stage-1 steps")
        return []

    def observe(self, step: int, shape, metrics: dict[str, Any]) -> list[str]:
        """Feed the host copy of a profile step's metrics (dsv/predictor_loss [depth], dsv/sparsity
        [depth, H]). Returns the decisions it changed, as log lines."""
        d = self.dsv
        loss = float(np.mean(metrics["dsv/predictor_loss"]))
        self.loss_ema = loss if self.loss_ema is None else d.ema * self.loss_ema + (1 - d.ema) * loss
        key = shape_key(shape)
        measured = np.asarray(metrics["dsv/sparsity"], np.float64)
        entry = self.shapes.get(key)
        if entry is None:
            entry = self.shapes[key] = {
                "sparsity": measured.tolist(),
                "recall_curve": [None] * self.depth,
                "rungs": [0.0] * self.depth,
                "profiles": 0,
                "backoff": 0,
                "last_profile": None,
                "sparse_since": None,
            }
        else:
            entry["sparsity"] = (d.ema * np.asarray(entry["sparsity"]) + (1 - d.ema) * measured).tolist()
        entry["profiles"] += 1
        entry["last_profile"] = int(step)
        curves = metrics.get("dsv/recall_curve")
        if curves is not None:
            for i, curve in enumerate(np.asarray(curves, np.float64)):
                if np.isfinite(curve).all():  # NaN: this block measured none (no predictor, or a padded layout)
                    old = entry["recall_curve"][i]
                    entry["recall_curve"][i] = (
                        curve if old is None else d.ema * np.asarray(old) + (1 - d.ema) * curve
                    ).tolist()
        if self.stage == 1:
            if self.loss_ema < d.switch_loss:
                return self._switch(step + 1, f"predictor loss {self.loss_ema:.4f} < {d.switch_loss}")
            return []
        return self._update_rungs(key, step + 1) + self._back_off(key)

    def _update_rungs(self, key: str, step: int) -> list[str]:
        """Decide a bucket's blocks for the steps from `step` on."""
        entry = self.shapes[key]
        keep = self._keep(entry)
        was_sparse = any(r > 0 for r in entry["rungs"])
        events = []
        for i in range(self.depth):
            new = self.decide(keep[i], entry["rungs"][i])
            if new != entry["rungs"][i]:
                events.append(f"block {i}: {_describe(entry['rungs'][i])} -> {_describe(new)}")
                entry["rungs"][i] = new
        if not any(r > 0 for r in entry["rungs"]):
            entry["sparse_since"] = None
        elif not was_sparse:
            entry["sparse_since"] = int(step)
            if self.first_sparse_step is None:
                self.first_sparse_step = int(step)
        return [f"DSV {key}: " + ", ".join(events)] if events else []

    def _back_off(self, key: str) -> list[str]:
        """After a stage-2 profile of a bucket: one back-off level more if every block stays dense, none once
        one is sparse (see the module docstring)."""
        entry = self.shapes[key]
        shape = tuple(int(v) for v in key.split("x"))
        if any(r > 0 for r in entry["rungs"]):
            if not entry["backoff"]:
                return []
            entry["backoff"] = 0
            profile, predictor = self.intervals(shape)
            return [f"DSV {key}: a block is sparse: profiles every {profile} steps, the predictor every {predictor}"]
        if entry["backoff"] >= self.max_backoff:
            return []
        entry["backoff"] += 1
        profile, predictor = self.intervals(shape)
        return [
            f"DSV {key}: every block dense: profiles every {profile} steps, the predictor every {predictor} (back-off)"
        ]

    def _switch(self, step: int, reason: str) -> list[str]:
        self.stage, self.switch_step = 2, int(step)
        lines = [f"DSV stage 2 from step {step} ({reason})"]
        for key in sorted(self.shapes):
            self._update_rungs(key, step)
            lines.append(f"  {key}: " + ", ".join(_describe(r) for r in self.shapes[key]["rungs"]))
        return ["\n".join(lines)]

    # -- logging and checkpoints --------------------------------------------------------------------
    def record(self, shape, *, step: int | None = None, profile: bool = False) -> dict[str, float]:
        """Scalars for the metrics log of a step on `shape`: stage and per-block decisions. With `step` (the
        training step that just ran, profiled or not), also what it did, which the controller counts."""
        rungs = self.rungs(shape)
        sparse = [self.stage == 2 and r > 0 for r in rungs]
        rec = {"dsv/stage": self.stage, "dsv/sparse_blocks": int(sum(sparse))}
        keep = self.keep(shape)
        for i, (s, r) in enumerate(zip(sparse, rungs)):
            rec[f"dsv/sparse/block{i}"] = int(s)
            rec[f"dsv/keep/block{i}"] = float(r) if s else 1.0
            rec[f"dsv/head_keep/block{i}"] = float(np.mean(keep[i]))  # the per-head ratios the rules ask for
        if step is not None:
            trains = self.trains_predictor(step, profile, shape)
            counts = self.counts[f"stage{self.stage}"]
            counts["steps"] += 1
            counts["predictor"] += int(trains)
            counts["profile"] += int(profile)
            every, predictor_every = self.intervals(shape)
            if every > self.dsv.profile_every:
                self.backoff_every = max(self.backoff_every, every)
            rec.update(
                {
                    "dsv/predictor_step": int(trains),
                    "dsv/profile_step": int(profile),
                    "dsv/profile_every": every,
                    "dsv/predictor_every": predictor_every if self.stage == 2 else 1,
                }
            )
        return rec

    def summary(self, shapes) -> dict[str, Any]:
        return {}

    def run_summary(self, costs: dict[str, float] | None = None) -> dict[str, Any]:
        """What DSV did over the run (the counted steps of every session of it): stage, sparse blocks, the steps
        that trained the predictor and that profiled, the back-off reached, and with `costs` (the trainer's
        `StepCosts.estimate()` of this session) what the predictor and the profiles cost; "dsv/summary" says
        it in words."""
        one, two = self.counts["stage1"], self.counts["stage2"]
        total = {k: one[k] + two[k] for k in COUNTS}
        out = {
            "dsv/steps": total["steps"],
            "dsv/predictor_steps": total["predictor"],
            "dsv/profile_steps": total["profile"],
            "dsv/stage2_steps": two["steps"],
            "dsv/stage2_predictor_steps": two["predictor"],
            "dsv/stage2_profile_steps": two["profile"],
            "dsv/backoff_every": self.backoff_every,
        }
        if self.first_sparse_step is not None:
            out["dsv/first_sparse_step"] = self.first_sparse_step
        words = [f"stage 2 from step {self.switch_step}" if self.stage == 2 else "stage 1"]
        sparse = {k: sum(r > 0 for r in e["rungs"]) for k, e in self.shapes.items()} if self.stage == 2 else {}
        if any(sparse.values()):
            words.append(
                "sparse blocks at the end: "
                + ", ".join(
                    f"{k} {n} of {self.depth}{_since(self.shapes[k]['sparse_since'])}" for k, n in sparse.items() if n
                )
            )
        else:
            words.append("every block dense at the end")
            if self.first_sparse_step is not None:
                words[-1] += f" (blocks were sparse from step {self.first_sparse_step})"
        words.append(
            f"the predictor trained on {total['predictor']} of {total['steps']} steps, {total['profile']} profiled"
        )
        if two["steps"]:
            words.append(f"in stage 2 {two['predictor']} of {two['steps']} steps trained it, {two['profile']} profiled")
        if self.backoff_every:
            words.append(f"back-off reached profiles every {self.backoff_every} steps")
        if costs:
            out.update({f"dsv/cost/{k}": v for k, v in costs.items()})
            parts = [f"a plain step {1e3 * costs['plain_step_s']:.1f} ms"] + [
                f"{kind} steps +{100 * costs[f'{kind}_extra']:.0f}%"
                for kind in ("predictor", "profile", "stage1")
                if f"{kind}_extra" in costs
            ]
            words.append(
                f"the predictor and the profiles cost ~{100 * costs['overhead']:.1f}% of the stage-2 steps "
                f"({', '.join(parts)}; measured this session)"
            )
        out["dsv/summary"] = "DSV: " + "; ".join(words)
        out.update(self.block_report())
        return out

    def block_report(self) -> dict[str, Any]:
        """Per bucket and block (lists in block order): `dsv/block_keep/<bucket>`, the keep ratio the rule
        asks for (mean over heads, as `dsv/head_keep`), and `dsv/block_recall/<bucket>`, the predictor's
        recall there: the attention mass its selection at each head's keep ratio holds, read off the profiled
        recall curve (None for a block without one yet); `dsv/blocks/<bucket>` says both, and which blocks
        attend sparsely, in a line."""
        out = {}
        for key, entry in sorted(self.shapes.items()):
            keep = self._keep(entry)
            recall = [
                None
                if curve is None
                else round(float(np.mean([np.interp(k, RECALL_FRACTIONS, c) for k, c in zip(keep[i], curve)])), 4)
                for i, curve in enumerate(entry["recall_curve"])
            ]
            means = [round(float(np.mean(k)), 4) for k in keep]
            sparse = [str(i) for i, r in enumerate(entry["rungs"]) if self.stage == 2 and r > 0]
            out[f"dsv/block_recall/{key}"], out[f"dsv/block_keep/{key}"] = recall, means
            out[f"dsv/blocks/{key}"] = (
                f"DSV {key} per block: predictor recall "
                + " ".join("-" if r is None else f"{r:.3f}" for r in recall)
                + " at keep "
                + " ".join(f"{k:.3f}" for k in means)
                + f"; sparse: {'blocks ' + ', '.join(sparse) if sparse else 'none'}"
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "switch_step": self.switch_step,
            "loss_ema": self.loss_ema,
            "recall_fractions": list(RECALL_FRACTIONS),
            "counts": {stage: dict(c) for stage, c in self.counts.items()},
            "first_sparse_step": self.first_sparse_step,
            "backoff_every": self.backoff_every,
            "shapes": {
                k: {
                    "sparsity": v["sparsity"],
                    "recall_curve": v["recall_curve"],
                    "rungs": v["rungs"],
                    "profiles": v["profiles"],
                    "backoff": v["backoff"],
                    "last_profile": v["last_profile"],
                    "sparse_since": v["sparse_since"],
                }
                for k, v in self.shapes.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`; a state saved before the back-off (no counts, back-off levels or profile
        steps) loads as one that never backed off, with its steps uncounted."""
        self.stage, self.switch_step, self.loss_ema = int(state["stage"]), state["switch_step"], state["loss_ema"]
        counts = state.get("counts") or {}
        self.counts = {stage: {k: int((counts.get(stage) or {}).get(k, 0)) for k in COUNTS} for stage in STAGES}
        self.first_sparse_step = _optional_int(state.get("first_sparse_step"))
        self.backoff_every = int(state.get("backoff_every") or 0)
        self.shapes = {}
        for k, v in state["shapes"].items():
            sparsity = np.asarray(v["sparsity"], np.float64)
            if sparsity.shape != (self.depth, self.heads) or len(v["rungs"]) != self.depth:
                raise ValueError(
                    f"DSV controller state for {k} has sparsity {sparsity.shape} and {len(v['rungs'])} "
                    f"rungs; the model has {self.depth} blocks x {self.heads} heads"
                )
            curves = v.get("recall_curve") or [None] * self.depth
            if "scale" in v and any(abs(float(x) - self.dsv.keep_scale) > 1e-9 for x in v["scale"]):
                log.warning(
                    "DSV controller state for %s: the per-block keep scales %s of an older version are "
                    "not used; keep ratios now follow the recall curves (dsv.recall_target)",
                    k,
                    v["scale"],
                )
            if list(state.get("recall_fractions", RECALL_FRACTIONS)) != list(RECALL_FRACTIONS):
                log.warning(
                    "DSV controller state for %s: recall curves measured at other keep ratios; dropped, "
                    "they are measured again on the next profiles",
                    k,
                )
                curves = [None] * self.depth
            bad = [
                np.shape(c)
                for c in curves
                if c is not None
                and (
                    np.shape(c) != (self.heads, len(RECALL_FRACTIONS))
                    or not np.isfinite(np.asarray(c, np.float64)).all()
                )
            ]
            if len(curves) != self.depth or bad:
                raise ValueError(
                    f"DSV controller state for {k} has recall curves for {len(curves)} blocks "
                    f"(bad: shapes {bad}, or non-finite values); the model has {self.depth} blocks x "
                    f"{self.heads} heads x {len(RECALL_FRACTIONS)} fractions"
                )
            self.shapes[k] = {
                "sparsity": sparsity.tolist(),
                "rungs": [float(r) for r in v["rungs"]],
                "recall_curve": [None if c is None else np.asarray(c, np.float64).tolist() for c in curves],
                "profiles": int(v["profiles"]),
                "backoff": int(v.get("backoff") or 0),
                "last_profile": _optional_int(v.get("last_profile")),
                "sparse_since": _optional_int(v.get("sparse_since")),  # an older state: not known
            }


STAGES = ("stage1", "stage2")
COUNTS = ("steps", "predictor", "profile")


def _since(step: int | None) -> str:
    return "" if step is None else f" (since step {step})"


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def _describe(rung: float) -> str:
    return f"sparse keep<={rung:g}" if rung > 0 else "dense"
