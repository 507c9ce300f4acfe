"""`AlignmentCallback`: token-level mask analysis around every real optimizer step of a run.

Hooked into `pdm_jax.trainer.Trainer` (``callbacks=[AlignmentCallback(...)]``),
it reads, never writes: before each RL optimizer step it recomputes the
trainer's logits π on the step's mini-batch with the current parameters (the
step donates them afterwards), the keep decision of every direction criterion
(`pdm_jax.analysis.alignment.token_analysis`), and optionally

* the full behaviour distribution μ, by recomputing the sampler's logits from
  an fp8/bf16 copy of the weights version that sampled the batch (quantized
  with the sampler's own code, `pdm_jax.sampler.engine.SamplingEngine`; each
  row uses the version in the batch's ``weights_version`` (the sampler's own
  record, among the last ``max_staleness + 1`` versions kept; a row whose version
  is not kept falls back to the kept version whose recomputed log μ(y_t) matches
  best, counted in ``behavior_version_fallbacks``), which adds the
  ``full`` oracle criterion and the estimator-fidelity counts;
* the *isolated* realized change: for up to ``isolated_tokens`` tokens outside
  the region, ΔD_t after a small normalized gradient step on token t's loss
  alone, −Â_t·sg(min(r_t, C))·log π(y_t) (see `isolated_changes`).

After the step it recomputes π with the new parameters on the same batch and
the same μ and records ΔD_t = D_t(after) − D_t(before) for every token
outside the region (Â ≠ 0), and (``param_direction``) the parameter-space
first-order change Ḋᵖ_t = ⟨∇_θ D_t, Δθ⟩ along the step's actual update
Δθ = θ_after − θ_before (`pdm_jax.analysis.param_direction`; the callback keeps
a device copy of θ_before, as the step donates it). Nothing here touches the trainer's state, RNG or
data stream; the no-op-on-training property is tested (tests/test_analysis_callback.py).
Meant for small models on one process: it copies each mini-batch and its
``[B,T,V]`` logits to the host.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pdm_jax.rl import train_step as ts
from pdm_jax.rl import trust_region as tr
from pdm_jax.analysis import alignment as al
from pdm_jax.analysis import param_direction as pd
from pdm_jax.callbacks import TrainerCallback
from pdm_jax.rl.step_batch import StepBatch
from pdm_jax.sampler.engine import SamplingEngine


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("temperature",))
def completion_logits_tau(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask, *,
                          temperature: float):
    """``[B,T,V]`` f32 logits of the completion tokens divided by τ (`train_step.completion_logits` / τ)."""
    logits = ts.completion_logits(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask)
    return logits / temperature


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("temperature", "tis_cap", "step_size"))
def isolated_changes(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask, behavior_logprobs,
                     topk_ids, topk_logprobs, advantages, cols, *, temperature: float, tis_cap: float,
                     step_size: float):
    """Realized ΔD_t of a small step on ONE token's loss, for N tokens in parallel (vmap).

    For token n (row n of the inputs, completion position ``cols[n]``) with loss
    ℓ_n(θ) = −Â_n·sg(min(r_n, C))·log π_θ(y_t) (the per-token truncated-IS loss),
    the step is θ' = θ − ε·∇ℓ_n/‖∇ℓ_n‖ (plain normalized gradient step of
    length ε = `step_size` in parameter space), and

        iso_delta_d[n]  = D_t(θ') − D_t(θ)          (realized, top-K KL, same μ)
        iso_first_order[n] = d/dε D_t(θ − ε ∇ℓ_n/‖∇ℓ_n‖) at ε = 0   (jax.jvp)

    Args:
      graphdef: the trainer's nnx graphdef (static).
      params: the trainer's parameters (nnx.State).
      prompt_ids [N,P], prompt_mask [N,P], completion_ids [N,T],
      completion_mask [N,T], behavior_logprobs [N,T], topk_ids [N,T,K],
      topk_logprobs [N,T,K], advantages [N] f32: one sequence per token
      (repeat a row to analyse several of its tokens).
      cols: [N] int32 completion position of each token.
      temperature, tis_cap, step_size: τ, C and ε (static).

    Returns:
      ``(iso_delta_d [N], iso_first_order [N], grad_norm [N])`` f32.
    """

    def one(p_ids, p_mask, c_ids, c_mask, beh, tk_ids, tk_lp, adv, col):
        rows = lambda x: x[None]  # noqa: E731

        def logits_at(prm):
            z = ts.completion_logits(graphdef, prm, rows(p_ids), rows(p_mask), rows(c_ids), rows(c_mask))
            return jax.lax.dynamic_index_in_dim(z[0] / temperature, col, axis=0, keepdims=False)  # [V]

        tok = c_ids[col]
        beh_t = beh[col]
        tk_ids_t = jax.lax.dynamic_index_in_dim(tk_ids, col, axis=0, keepdims=False)
        tk_lp_t = jax.lax.dynamic_index_in_dim(tk_lp, col, axis=0, keepdims=False)

        def d_of(prm):
            return tr.topk_kl(logits_at(prm), tok, tk_ids_t, tk_lp_t, beh_t)

        def loss(prm):
            logp = jax.nn.log_softmax(logits_at(prm))[tok]
            c = jnp.minimum(jnp.exp(logp - beh_t), tis_cap)
            return -adv * jax.lax.stop_gradient(c) * logp

        g = jax.grad(loss)(params)
        gnorm = optax.tree.norm(g)
        direction = jax.tree.map(lambda x: -x / jnp.maximum(gnorm, 1e-30), g)
        new = jax.tree.map(lambda p, d: p + step_size * d, params, direction)
        d0, first = jax.jvp(d_of, (params,), (direction,))
        return d_of(new) - d0, first, gnorm

    return jax.vmap(one)(prompt_ids, prompt_mask, completion_ids, completion_mask, behavior_logprobs, topk_ids,
                         topk_logprobs, advantages, cols)


class AlignmentCallback(TrainerCallback):
    """Records, per optimizer step, the keep decisions and the realized ΔD of tokens outside the region.

    Args:
      full_mu: recompute the behaviour logits from the rollout engine's copy of the weights (the config's
        ``sampler.quantization`` and ``sampler.weight_noise``; adds the ``full`` oracle criterion and
        estimator-fidelity counts); costs up to ``max_staleness + 1`` extra forwards per step.
      isolated_tokens: N > 0 enables the isolated mode on up to N tokens per
        optimizer step (chosen uniformly at random, with a local RNG, among the
        tokens outside the region with Â ≠ 0); 0 = off.
      isolated_step: ε, the length of the isolated normalized gradient step
        (parameter-space L2 norm).
      seed: seed of the local RNG choosing the isolated tokens.
      param_direction: record Ḋᵖ (``dir_param_jvp``) and the ``param_jvp``
        keep decision along the real update (one device copy of the parameters
        and one forward-mode pass through the model per optimizer step).

    Attributes (host numpy, filled during the run):
      records: list (one per optimizer step) of dicts of ``[N_i]`` arrays, see
        `alignment.select_tokens`, plus ``rl_step``, ``update`` (optimizer
        step index in the run), ``iso_delta_d``/``iso_first_order`` (NaN where
        not measured).
      steps: list of per-optimizer-step dicts (``rl_step``, ``update``,
        ``num_valid``, ``num_outside``, ``num_selected``, ``mean_d_before`` (mean
        top-K KL over the valid tokens before the step), ``trainer_mean_topk_kl``
        and ``trainer_frac_outside`` (the step's own metrics, for cross-checking),
        ``behavior_version_lag`` (max over rows of rl_step - 1 - version),
        ``behavior_logprob_max_err`` (max |recomputed − sampler log μ(y_t)|),
        ``behavior_version_fallbacks`` (rows matched by log μ instead),
        ``param_jvp_d_max_err`` (max over valid tokens of |D from the jvp's
        primal − d_before|: the jvp saw the trainer's logits; None when off)).
      fidelity: summed `alignment.fidelity_counts` (None without ``full_mu``).

    Raises:
      ValueError: isolated_tokens < 0 or isolated_step <= 0.
    """

    def __init__(self, *, full_mu: bool = True, isolated_tokens: int = 0, isolated_step: float = 1e-2, seed: int = 0,
                 param_direction: bool = True):
        if isolated_tokens < 0:
            raise ValueError(f"isolated_tokens must be >= 0, got {isolated_tokens}")
        if not isolated_step > 0:
            raise ValueError(f"isolated_step must be > 0, got {isolated_step}")
        self.full_mu = bool(full_mu)
        self.param_direction = bool(param_direction)
        self.isolated_tokens = int(isolated_tokens)
        self.isolated_step = float(isolated_step)
        self._rng = np.random.default_rng(seed)
        self.records: list = []
        self.steps: list = []
        self.fidelity: Optional[dict] = None
        self._pending = None
        self._engine = None
        self._behavior_params: dict = {}  # version -> (graphdef, quantized nnx.State)
        self._last_rl_step = None
        self._updates = 0

    # ------------------------------------------------------------------ behaviour policy
    def _snapshot_version(self, trainer, version: int, params) -> None:
        sc = trainer.spec.sampler
        if self._engine is None:  # the rollout engine's copy: its quantization and its weight noise
            self._engine = SamplingEngine(trainer.model_config, params, quantization=sc.quantization, version=version,
                                          weight_noise=sc.weight_noise, weight_noise_seed=sc.weight_noise_seed,
                                          max_prompt_length=8, max_new_tokens=8, min_new_tokens_bucket=1)
        else:
            self._engine.set_params(params, version=version)
        graphdef, state = nnx.split(self._engine.model())
        self._behavior_params[version] = (graphdef, state)
        keep = trainer.spec.rl.max_staleness + 1
        for v in sorted(self._behavior_params)[:-keep]:
            del self._behavior_params[v]

    def _version_logits(self, version: int, host: StepBatch, tau: float):
        """(z_q/τ [B,T,V] numpy, log μ(y_t) [B,T]) of all rows under weights ``version``."""
        graphdef, state = self._behavior_params[version]
        z = np.asarray(completion_logits_tau(graphdef, state, host.prompt_ids, host.prompt_mask,
                                             host.completion_ids, host.completion_mask, temperature=tau))
        zmax = z.max(-1, keepdims=True)
        logmu = z - zmax - np.log(np.sum(np.exp(z - zmax), -1, keepdims=True))
        return z, np.take_along_axis(logmu, host.completion_ids[..., None], -1)[..., 0]

    def _behavior_logits(self, trainer, host: StepBatch, tau: float, rl_step: int):
        """Behaviour logits of every row from the weights version that sampled it.

        Returns (z_q/τ [B,T,V] numpy, version lag, max |Δ log μ(y_t)|, number of fallback rows).
        """
        valid = host.completion_mask
        versions_B = np.asarray(host.weights_version, np.int64)
        cache = {}

        def logits(v):
            if v not in cache:
                cache[v] = self._version_logits(v, host, tau)
            return cache[v]

        def row_err(lp, rows):
            return np.max(np.abs(np.where(valid[rows], lp[rows] - host.behavior_logprobs[rows], 0.0)),
                          axis=-1, initial=0.0)

        z_out = None
        used_B = np.empty_like(versions_B)
        fallbacks = 0
        for v in np.unique(versions_B):
            rows = np.flatnonzero(versions_B == v)
            if int(v) in self._behavior_params:
                best = int(v)
            else:  # not kept (older than max_staleness + 1 versions): best log μ match
                fallbacks += len(rows)
                best = min(self._behavior_params, key=lambda u: float(row_err(logits(u)[1], rows).max()))
            z, _ = logits(best)
            if z_out is None:
                z_out = np.empty_like(z)
            z_out[rows] = z[rows]
            used_B[rows] = best
        err = max(float(row_err(logits(int(u))[1], np.flatnonzero(used_B == u)).max()) for u in np.unique(used_B))
        lag = int(np.max(rl_step - 1 - used_B))
        return z_out, lag, err, fallbacks

    # ------------------------------------------------------------------ hooks
    def before_update(self, trainer, rl_step, batch, state) -> None:
        if jax.process_count() > 1:
            raise RuntimeError("AlignmentCallback reads whole batches on the host: single-process runs only "
                               f"(jax.process_count() = {jax.process_count()})")
        tau = trainer.spec.rl.temperature
        if rl_step != self._last_rl_step:
            # The parameters at the first optimizer step of RL step s are weights version s - 1.
            if self.full_mu:
                self._snapshot_version(trainer, rl_step - 1, state.params)
            self._last_rl_step = rl_step
        host = jax.tree.map(np.asarray, jax.device_get(batch))
        logits_before = np.asarray(completion_logits_tau(
            trainer.graphdef, state.params, host.prompt_ids, host.prompt_mask, host.completion_ids,
            host.completion_mask, temperature=tau))
        trc = trainer.spec.step.trust_region
        behavior_logits, lag, err, fallbacks = None, None, None, None
        if self.full_mu and self._behavior_params:
            # mu at the rollouts' temperature (sampler.temperature; rl.temperature unless set), pi at rl.temperature.
            behavior_logits, lag, err, fallbacks = self._behavior_logits(
                trainer, host, trainer.spec.rollout.temperature, rl_step)
            fid = al.fidelity_analysis(logits_before, behavior_logits, host.completion_ids,
                                       host.completion_mask, k=int(host.topk_ids.shape[-1]))
            self.fidelity = al.add_fidelity_counts(self.fidelity, al.fidelity_counts(fid))
        analysis = dict(jax.device_get(al.token_analysis(
            logits_before, logits_before, host, delta=float(trc.delta), delta_low=trc.delta_low,
            delta_high=trc.delta_high, behavior_logits=behavior_logits)))
        iso_d = np.full(host.completion_ids.shape, np.nan, np.float32)
        iso_f = np.full(host.completion_ids.shape, np.nan, np.float32)
        if self.isolated_tokens:
            cand = np.argwhere(analysis["valid"] & analysis["outside"] & (analysis["advantage"] != 0))
            if len(cand):
                pick = cand[self._rng.permutation(len(cand))[: self.isolated_tokens]]
                n = self.isolated_tokens
                idx = np.concatenate([pick, np.repeat(pick[:1], n - len(pick), axis=0)])  # static N
                rows, cols = idx[:, 0], idx[:, 1]
                adv = np.asarray(host.advantages, np.float32)
                adv_rows = adv[rows] if adv.ndim == 1 else adv[rows, cols]
                d, f, _ = jax.device_get(isolated_changes(
                    trainer.graphdef, state.params, host.prompt_ids[rows], host.prompt_mask[rows],
                    host.completion_ids[rows], host.completion_mask[rows], host.behavior_logprobs[rows],
                    host.topk_ids[rows], host.topk_logprobs[rows], adv_rows, cols.astype(np.int32),
                    temperature=tau, tis_cap=trainer.spec.rl.tis_cap, step_size=self.isolated_step))
                m = len(pick)
                iso_d[rows[:m], cols[:m]] = np.asarray(d)[:m]
                iso_f[rows[:m], cols[:m]] = np.asarray(f)[:m]
        analysis["iso_delta_d"] = iso_d
        analysis["iso_first_order"] = iso_f
        # A device copy: the optimizer step donates (and may overwrite) state.params.
        params_before = jax.tree.map(jnp.copy, state.params) if self.param_direction else None
        self._pending = dict(host=host, analysis=analysis, rl_step=rl_step, lag=lag, err=err, fallbacks=fallbacks,
                             params_before=params_before)

    def after_update(self, trainer, rl_step, batch, state, metrics) -> None:
        p = self._pending
        self._pending = None
        if p is None:
            return
        host, analysis = p["host"], p["analysis"]
        logits_after = completion_logits_tau(
            trainer.graphdef, state.params, host.prompt_ids, host.prompt_mask, host.completion_ids,
            host.completion_mask, temperature=trainer.spec.rl.temperature)
        d_after = np.asarray(tr.topk_kl(logits_after, host.completion_ids, host.topk_ids,
                                        host.topk_logprobs, host.behavior_logprobs))
        analysis["d_after"] = d_after
        analysis["delta_d"] = d_after - analysis["d_before"]
        jvp_err = None
        if p["params_before"] is not None:
            before = p["params_before"]
            d_jvp, d_dot = jax.device_get(pd.param_jvp_topk_kl(
                trainer.graphdef, before, pd.parameter_update(before, state.params), host.prompt_ids,
                host.prompt_mask, host.completion_ids, host.completion_mask, host.topk_ids, host.topk_logprobs,
                host.behavior_logprobs, temperature=trainer.spec.rl.temperature))
            d_dot = np.asarray(d_dot)
            analysis[f"dir_{pd.PARAM_CRITERION}"] = d_dot
            analysis[f"keep_{pd.PARAM_CRITERION}"] = np.asarray(al.param_keep(d_dot, analysis["outside"]))
            valid = analysis["valid"]
            jvp_err = float(np.abs(np.asarray(d_jvp) - analysis["d_before"])[valid].max()) if valid.any() else 0.0
        rec = al.select_tokens(analysis)
        n = len(rec["row"])
        rec["rl_step"] = np.full((n,), rl_step, np.int32)
        rec["update"] = np.full((n,), self._updates, np.int32)
        self.records.append(rec)
        valid = analysis["valid"]
        m = jax.device_get({k: metrics[k] for k in ("mean_topk_kl", "frac_outside") if k in metrics})
        self.steps.append(dict(rl_step=int(rl_step), update=self._updates, num_valid=int(valid.sum()),
                               num_outside=int((valid & analysis["outside"]).sum()), num_selected=n,
                               mean_d_before=float(analysis["d_before"][valid].mean()) if valid.any() else 0.0,
                               trainer_mean_topk_kl=float(m.get("mean_topk_kl", np.nan)),
                               trainer_frac_outside=float(m.get("frac_outside", np.nan)),
                               behavior_version_lag=p["lag"], behavior_logprob_max_err=p["err"],
                               behavior_version_fallbacks=p["fallbacks"], param_jvp_d_max_err=jvp_err))
        self._updates += 1

    # ------------------------------------------------------------------ results
    def token_records(self) -> dict:
        """All recorded tokens of the run, concatenated (`alignment.concat_records`)."""
        return al.concat_records(self.records)
