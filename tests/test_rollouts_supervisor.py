"""SamplerSupervisor: rejections surface the server's message, restarts keep to their budget, stalls are noticed.

Fast tests replace `start_sampler_server` with a scripted fake (each start
returns a fake process, or dies during start-up); the stall test talks to a
real socket that accepts connections and never answers (what a SIGSTOPped
server looks like from outside).  The slow test SIGSTOPs a real sampler
subprocess.
"""
import dataclasses
import json
import logging
import os
import signal
import socket
import threading
import time
import types

import jax
import numpy as np
import pytest

from pdm_jax.config import get_base_config
from pdm_jax.models.qwen3 import Qwen3Config
from pdm_jax.rollout import RolloutBatch
from pdm_jax.rollouts import supervisor as sup_mod
from pdm_jax.sampler import weights as wts
from pdm_jax.sampler import wire
from pdm_jax.rollouts.client import SamplerClient, SamplerError, SamplerRequestError
from pdm_jax.rollouts.launcher import SamplerStartupError
from pdm_jax.rollouts.supervisor import SamplerFailure, SamplerRejected, SamplerSpec, SamplerSupervisor


def sampler_config(**over):
    """The base config's `SamplerSpec` with a subprocess sampler (16-token prompts, batches of 8, 30 s start-up,
    3 retries and restarts) and ``over``'s fields."""
    base = dict(mode="subprocess", address="", token="", quantization="none", startup_timeout_s=30.0,
                request_timeout_s=300.0, retries=3, max_restarts=3, max_prompt_length=16, max_batch_size=8)
    return dataclasses.replace(SamplerSpec.from_config(get_base_config().sampler), **{**base, **over})


def answer(prompts, n=1, top_k_logprobs=20, t=3, tag=0):
    """A valid `RolloutBatch` answering ``prompts`` (``n`` rows each, 3 tokens, K log mu of mass 1/2);
    ``tag`` goes into ``weights_version`` so a test can tell answers apart."""
    rows, k, p = len(prompts) * n, top_k_logprobs, max(len(x) for x in prompts)
    pid = np.zeros((rows, p), np.int32)
    pmask = np.zeros((rows, p), bool)
    for r in range(rows):
        ids = prompts[r // n]
        pid[r, p - len(ids):], pmask[r, p - len(ids):] = ids, True
    return RolloutBatch(prompt_ids=pid, prompt_mask=pmask, completion_ids=np.ones((rows, t), np.int32),
                        completion_mask=np.ones((rows, t), bool), behavior_logprobs=np.full((rows, t), -1.0),
                        topk_ids=np.tile(np.arange(k, dtype=np.int32), (rows, t, 1)),
                        topk_logprobs=np.full((rows, t, k), np.log(0.5 / k)),
                        weights_version=np.full(rows, tag, np.int32),
                        group_ids=np.repeat(np.arange(len(prompts), dtype=np.int32), n),
                        finish_reason=np.array(["length"] * rows, dtype=object))


class FakeClient:
    """Scripted sampler client: `behaviour` is "ok", "dead" (5xx / connection errors) or "reject" (a 422)."""

    def __init__(self, behaviour):
        self.behaviour, self.calls = behaviour, 0

    def _go(self, result):
        self.calls += 1
        if self.behaviour == "dead":
            raise SamplerError("POST /v1/generate failed after 4 attempt(s): ConnectError: refused")
        if self.behaviour == "reject":
            raise SamplerRequestError(422, "path: weights version directory '/w/v1': parameter ['w'] holds 1 "
                                           "non-finite value(s) (NaN/inf) of 4; refused", "path")
        return result

    def generate(self, prompts, params=None, **kw):
        return self._go(answer(prompts))

    def load_weights(self, path, version):
        return self._go({"version": version})

    def probe(self, timeout_s):
        return self.behaviour != "dead"


class FakeProcess:
    def __init__(self, client, on_kill=None):
        self.client, self.stopped, self.killed, self._on_kill = client, False, False, on_kill
        self.proc = types.SimpleNamespace(kill=self.kill, pid=-1)

    def stop(self):
        self.stopped = True

    def kill(self):
        self.killed = True
        if self._on_kill:
            self._on_kill()


@pytest.fixture
def script(monkeypatch):
    """`script(*steps)`: each start takes the next step (a FakeProcess, or an exception it raises)."""
    starts = []

    def install(*steps):
        queue = list(steps)

        def fake_start(**kw):
            starts.append(kw)
            step = queue.pop(0)
            if isinstance(step, Exception):
                raise step
            return step
        monkeypatch.setattr(sup_mod, "start_sampler_server", fake_start)
        return starts
    return install


def supervisor(tmp_path, **over):
    return SamplerSupervisor(sampler_config(**over), workdir=str(tmp_path), model_config=None, max_new_tokens=8)


def died():
    return SamplerStartupError("sampler server exited with code -9 before answering /health; output tail: ...")


# ----------------------------------------------------------------------------- rejections
def test_a_4xx_surfaces_the_servers_message_and_is_never_restarted(tmp_path, script):
    starts = script(FakeProcess(FakeClient("reject")))
    s = supervisor(tmp_path)
    s.start(0)
    with pytest.raises(SamplerRejected) as e:
        s.sync({"w": np.array([1.0, np.nan, 2.0, 3.0], np.float32)}, 1)
    err = e.value
    assert err.status == 422 and err.field == "path" and err.call == "load_weights"
    assert "non-finite" in str(err) and "weights version 1 at" in str(err) and "HTTP 422" in str(err)
    assert isinstance(err, ValueError) and not isinstance(err, SamplerFailure)
    assert s.restarts_total == 0 and len(starts) == 1 and s.version == 0  # no restart; still on version 0


def test_in_process_rejection_carries_the_field(tmp_path):
    s = SamplerSupervisor(sampler_config(mode="in_process"), workdir=str(tmp_path), model_config=None,
                          max_new_tokens=8)
    s._sampler = types.SimpleNamespace(generate=lambda *a, **k: (_ for _ in ()).throw(
        wire.RequestError("top_p", "must be a number in (0, 1], got True (bool)")))
    with pytest.raises(SamplerRejected) as e:
        s.generate([[1, 2]], top_p=True)
    assert e.value.field == "top_p" and e.value.status is None and "True (bool)" in str(e.value)


# ----------------------------------------------------------------------------- restart budget
def test_dead_sampler_is_restarted_with_sigterm(tmp_path, script):
    first = FakeProcess(FakeClient("dead"))
    starts = script(first, FakeProcess(FakeClient("ok")))
    s = supervisor(tmp_path)
    s.start(0)
    assert s.generate([[1]]).num_sequences == 1
    assert s.restarts_total == 1 and len(starts) == 2 and first.stopped and not first.killed


def test_replacements_dying_at_startup_count_against_max_restarts(tmp_path, script):
    """Two replacements die during their own start-up; the third serves: 3 restarts of a budget of 3, no failure."""
    starts = script(FakeProcess(FakeClient("dead")), died(), died(), FakeProcess(FakeClient("ok")))
    s = supervisor(tmp_path, max_restarts=3)
    s.start(0)
    assert s.generate([[1], [2]]).num_sequences == 2
    assert s.restarts_total == 3 and len(starts) == 4


def test_the_budget_ends_with_a_failure_naming_the_startup_error(tmp_path, script):
    starts = script(FakeProcess(FakeClient("dead")), died(), died(), died(), FakeProcess(FakeClient("ok")))
    s = supervisor(tmp_path, max_restarts=3)
    s.start(0)
    with pytest.raises(SamplerFailure, match=r"failed after 3 restart\(s\) \(sampler.max_restarts = 3\).*"
                                             r"the last start-up failed: sampler server exited with code -9"):
        s.generate([[1]])
    assert s.restarts_total == 3 and len(starts) == 4  # 1 start + 3 replacements, the 4th never tried


# ----------------------------------------------------------------------------- stalls
class SilentServer:
    """A loopback socket that accepts connections and never answers; `close()` is the 'kill'."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self):
        self.sock.close()


def test_stall_is_detected_from_missed_probes_within_seconds(tmp_path, script, caplog):
    silent = SilentServer()
    stalled = FakeProcess(SamplerClient(silent.url, timeout_s=300.0, retries=3), on_kill=silent.close)
    starts = script(stalled, FakeProcess(FakeClient("ok")))
    s = supervisor(tmp_path, stall_probe_interval_s=0.2, stall_probe_timeout_s=0.3, stall_probe_misses=3)
    s.start(0)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pdm_jax.sampler"):
        out = s.generate([[1, 2]])
    elapsed = time.monotonic() - t0
    assert out.num_sequences == 1
    assert elapsed < 5.0, elapsed  # 3 x (0.2 + 0.3) s = 1.5 s, not 4 x 300 s
    assert s.stalls_total == 1 and s.restarts_total == 1 and len(starts) == 2
    assert stalled.killed and not stalled.stopped  # SIGKILL: a stopped process never acts on SIGTERM
    assert "probe missed (3/3)" in caplog.text and "sampler stalled" in caplog.text


def test_a_slow_but_answering_sampler_is_not_a_stall(tmp_path, script):
    class Slow(FakeClient):
        def generate(self, prompts, params=None, **kw):
            time.sleep(1.0)
            return answer(prompts, tag=7)
    script(FakeProcess(Slow("ok")))
    s = supervisor(tmp_path, stall_probe_interval_s=0.1, stall_probe_timeout_s=0.1, stall_probe_misses=2)
    s.start(0)
    assert s.generate([[1]]).weights_version.tolist() == [7]
    assert s.stalls_total == 0 and s.restarts_total == 0


def test_a_stalled_remote_sampler_is_a_failure(tmp_path):
    silent = SilentServer()
    s = supervisor(tmp_path, mode="remote", stall_probe_interval_s=0.2, stall_probe_timeout_s=0.2,
                   stall_probe_misses=2)
    s._sampler = SamplerClient(silent.url, timeout_s=300.0, retries=0)  # as start() leaves it for mode=remote
    t0 = time.monotonic()
    with pytest.raises(SamplerFailure, match="sampler stalled: 2 consecutive /health probes"):
        s.generate([[1]])
    assert time.monotonic() - t0 < 5.0
    silent.close()


def test_probe_settings_come_from_the_config_with_defaults(tmp_path):
    s = supervisor(tmp_path)
    c = get_base_config().sampler
    assert (s.stall_probe_interval_s, s.stall_probe_timeout_s, s.stall_probe_misses) == (
        c.stall_probe_interval_s, c.stall_probe_timeout_s, c.stall_probe_misses) == (10.0, 10.0, 3)
    s = SamplerSupervisor(sampler_config(stall_probe_interval_s=2.0, stall_probe_timeout_s=1.0,
                                         stall_probe_misses=0), workdir=str(tmp_path), model_config=None,
                          max_new_tokens=8)
    assert (s.stall_probe_interval_s, s.stall_probe_timeout_s, s.stall_probe_misses) == (2.0, 1.0, 0)
    with pytest.raises(ValueError, match="stall_probe_interval_s > 0"):
        supervisor(tmp_path, stall_probe_interval_s=0.0)
    with pytest.raises(ValueError, match="stall_probe_misses"):
        supervisor(tmp_path, stall_probe_misses=-1)
    with pytest.raises(ValueError, match="stall_probe_misses"):
        supervisor(tmp_path, stall_probe_misses=True)


# ----------------------------------------------------------------------------- a real SIGSTOP
@pytest.mark.slow
def test_sigstopped_subprocess_is_killed_and_replaced(tmp_path):
    """A real sampler subprocess is SIGSTOPped between two generations: noticed within seconds, restarted,
    and the retried request (same seed) returns the same rollouts as before the stall.  Then a NaN weights
    version is refused with the server's 422, without a restart."""
    cfg = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    os.makedirs(tmp_path / "model")
    with open(tmp_path / "model" / "config.json", "w") as f:
        json.dump(cfg.to_hf_dict(), f)
    s = SamplerSupervisor(sampler_config(startup_timeout_s=240.0, request_timeout_s=300.0, retries=1,
                                         stall_probe_interval_s=1.0, stall_probe_timeout_s=1.0, stall_probe_misses=3),
                          workdir=str(tmp_path), model_config=cfg, max_new_tokens=8)
    rng = np.random.default_rng(0)
    s.push_weights(jax.tree.map(lambda a: (rng.standard_normal(a.shape) * 0.1).astype(np.float32),
                                wts.abstract_params(cfg)), 0)
    s.start(0)
    restarts_at = []
    real_restart = s._restart
    s._restart = lambda *a: (restarts_at.append(time.monotonic()), real_restart(*a))[1]
    try:
        kw = dict(n=2, max_new_tokens=6, top_k_logprobs=3, temperature=0.7, seed=11)
        before = s.generate([[1, 2, 3]], **kw)
        stopped = s._proc.proc
        os.kill(stopped.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        after = s.generate([[1, 2, 3]], **kw)
        assert restarts_at and restarts_at[0] - t0 < 12.0, restarts_at  # 3 x (1 + 1) s + slack, not 4 x 300 s
        assert stopped.poll() is not None  # the stopped process was killed
        assert s.stalls_total == 1 and s.restarts_total == 1
        np.testing.assert_array_equal(after.completion_ids, before.completion_ids)
        np.testing.assert_array_equal(after.topk_logprobs, before.topk_logprobs)
        # a NaN weights version: the server's 422 reaches the trainer; no restart, the version stays
        bad = jax.tree.map(lambda a: np.full(a.shape, np.nan, np.float32), wts.abstract_params(cfg))
        with pytest.raises(SamplerRejected) as e:
            s.sync(bad, 1)
        assert e.value.status == 422 and e.value.field == "path" and "non-finite" in str(e.value)
        health = s.call("health", lambda sampler: sampler.health())
        assert s.restarts_total == 1 and health["version"] == 0 and s.version == 0
    finally:
        s.stop()


def test_threads_left_behind_end(tmp_path, script):
    """The abandoned worker of a stalled call ends once its sampler is gone (no thread leak per stall)."""
    silent = SilentServer()
    stalled = FakeProcess(SamplerClient(silent.url, timeout_s=300.0, retries=0), on_kill=silent.close)
    script(stalled, FakeProcess(FakeClient("ok")))
    s = supervisor(tmp_path, stall_probe_interval_s=0.1, stall_probe_timeout_s=0.1, stall_probe_misses=2)
    s.start(0)
    s.generate([[1]])
    deadline = time.monotonic() + 10
    while any(t.name == "sampler-generate" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the stalled call's worker thread is still alive"
        time.sleep(0.05)


def _corrupt(batch, **changes):
    fields = {f: getattr(batch, f) for f in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                              "behavior_logprobs", "topk_ids", "topk_logprobs", "weights_version",
                                              "group_ids", "finish_reason")}
    for name, fn in changes.items():
        fields[name] = fn(np.array(fields[name]))
    return RolloutBatch(**fields)


def _set(index, value):
    def fn(a):
        a[index] = value
        return a
    return fn


@pytest.mark.parametrize("changes,field", [
    (dict(group_ids=lambda g: g[[2, 3, 0, 1]]), "group_ids[0] = 1: rows must be prompt-major"),
    (dict(group_ids=_set(0, -1)), "group_ids[0] = -1"),
    (dict(prompt_ids=lambda p: p[[2, 3, 0, 1]], group_ids=lambda g: g), "prompt_ids[0] is not the ids of prompt 0"),
    (dict(behavior_logprobs=_set((1, 2), -np.inf)), "behavior_logprobs[1, 2] = -inf"),
    (dict(behavior_logprobs=_set((0, 0), 0.5)), "behavior_logprobs[0, 0] = 0.5"),
    (dict(topk_logprobs=lambda t: t + np.log(7.8)), "top-K probabilities sum to 3.9"),
    (dict(topk_logprobs=_set((0, 0, 1), np.nan)), "topk_logprobs[0, 0, 1] = nan"),
    (dict(completion_ids=_set((3, 1), -4)), "completion_ids[3, 1] = -4: outside [0, 64)"),
    (dict(topk_ids=_set((2, 0, 0), 64)), "topk_ids[2, 0, 0] = 64: outside [0, 64)"),
])
def test_rollouts_that_do_not_answer_the_request_are_refused_naming_the_field(tmp_path, script, changes, field):
    """Whatever a sampler sends, the supervisor checks it against the request before training on it."""
    prompts = [[5, 6], [7]]

    class Hostile(FakeClient):
        def generate(self, prompts, params=None, **kw):
            return _corrupt(answer(prompts, n=2, top_k_logprobs=4), **changes)
    script(FakeProcess(Hostile("ok")))
    s = SamplerSupervisor(sampler_config(), workdir=str(tmp_path), model_config=types.SimpleNamespace(vocab_size=64),
                          max_new_tokens=8)
    s.start(0)
    with pytest.raises(sup_mod.SamplerResponseError, match=r"do not answer the request: RolloutBatch\.") as e:
        s.generate(prompts, n=2, top_k_logprobs=4)
    assert field in str(e.value)
    assert s.restarts_total == 0


def test_more_rows_longer_completions_or_another_k_are_refused(tmp_path, script):
    prompts = [[5, 6], [7]]
    cases = [(dict(n=1, top_k_logprobs=4), "4 rows for 2 prompts x n = 1"),
             (dict(n=2, max_new_tokens=2, top_k_logprobs=4), "more than the request's"),
             (dict(n=2, top_k_logprobs=3), "K = 4, the request asked for 3")]
    for kw, want in cases:
        class Fixed(FakeClient):
            def generate(self, prompts, params=None, **k):
                return answer(prompts, n=2, top_k_logprobs=4)
        script(FakeProcess(Fixed("ok")))
        s = supervisor(tmp_path)
        s.start(0)
        with pytest.raises(sup_mod.SamplerResponseError, match=want):
            s.generate(prompts, **kw)
        s.stop()
    s = supervisor(tmp_path)
    script(FakeProcess(Fixed("ok")))
    s.start(0)
    assert s.generate(prompts, n=2, top_k_logprobs=4).num_sequences == 4  # the same answer, asked for right


def test_a_remote_native_server_with_another_weight_noise_is_refused(tmp_path, monkeypatch):
    """sampler.weight_noise with mode=remote: the running server's /health must report the same --weight_noise and
    --weight_noise_seed, else the start fails naming both values (a server started by hand without the flags would
    sample from another copy than the run says); a missing, null or malformed value is named too."""
    class Remote(FakeClient):
        def health(self):
            return self.body

    client = Remote("ok")
    monkeypatch.setattr(SamplerSupervisor, "_remote_client", lambda self, sc: client)
    cases = [({"weight_noise": 0.0}, dict(weight_noise=0.1), "sampler.weight_noise = 0.1 .*--weight_noise=0.0"),
             ({"weight_noise": 0.1}, dict(weight_noise=0.0), "sampler.weight_noise = 0.0 .*--weight_noise=0.1"),
             ({"weight_noise": 0.1}, dict(weight_noise=0.1, weight_noise_seed=7),  # the seed is compared too
              "sampler.weight_noise_seed = 7 .*--weight_noise_seed=0"),
             ({"weight_noise": None}, dict(weight_noise=0.1), "--weight_noise=None"),
             ({"weight_noise": "abc"}, dict(weight_noise=0.1), "--weight_noise='abc'"),
             ({"weight_noise": [0.1]}, dict(weight_noise=0.1), "--weight_noise=\\[0.1\\]"),
             ({"weight_noise": 0.1, "weight_noise_seed": 7}, dict(weight_noise=0.1, weight_noise_seed=7), None),
             ({}, {}, None)]  # a server that reports neither field: no noise, seed 0
    for body, spec, error in cases:
        client.body = {"status": "ok", **body}
        s = supervisor(tmp_path, mode="remote", address="http://127.0.0.1:9", **spec)
        if error is None:
            s.start(0)
            assert s.version == 0
        else:
            with pytest.raises(ValueError, match=error):
                s.start(0)
