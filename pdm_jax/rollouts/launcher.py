"""Start the sampler service as a subprocess and wait until it answers ``/health``.

``start_sampler_server(...)`` runs ``python -m pdm_jax.sampler.server`` with a
port file (``--port=0`` lets the OS pick a free port), polls the port file and
then ``GET /health`` until ``startup_timeout_s``; if the process exits or never
comes up it is killed and a `SamplerStartupError` carries the tail of its
stderr.  The returned `SamplerProcess` has ``.url``, ``.client``, ``.alive()``,
``.stop()``, ``.kill()`` and ``.restart()`` (same flags, new port).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Optional, Sequence

from pdm_jax.sampler.spec import EngineSpec
from pdm_jax.rollouts.client import SamplerClient, SamplerError


class SamplerStartupError(RuntimeError):
    """The sampler subprocess died or did not answer /health in time (message has its stderr tail)."""


def _tail(path: str, n_chars: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n_chars))
            return f.read().decode(errors="replace")
    except OSError:
        return "<no stderr>"


class SamplerProcess:
    """A running sampler subprocess (see `start_sampler_server`)."""

    def __init__(self, argv: Sequence[str], *, host: str, token: Optional[str], startup_timeout_s: float,
                 client_kwargs: Optional[dict] = None, env: Optional[dict] = None):
        self._argv = list(argv)
        self._host, self._token = host, token
        self._startup_timeout_s = float(startup_timeout_s)
        self._client_kwargs = dict(client_kwargs or {})
        self._env = env
        self.proc: Optional[subprocess.Popen] = None
        self.client: Optional[SamplerClient] = None
        self.url: Optional[str] = None
        self.port: Optional[int] = None
        self._start()

    @property
    def stderr_path(self) -> str:
        """File receiving the subprocess's stdout+stderr."""
        return self._log_path

    def _start(self) -> None:
        self._workdir = tempfile.mkdtemp(prefix="pdm_sampler_")
        port_file = os.path.join(self._workdir, "port")
        self._log_path = os.path.join(self._workdir, "server.log")
        argv = self._argv + [f"--port_file={port_file}"]
        log = open(self._log_path, "wb")
        env = dict(os.environ if self._env is None else self._env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self._token:  # via the environment, not argv (argv is visible to `ps`)
            env["PDM_SAMPLER_TOKEN"] = self._token
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + self._startup_timeout_s
        try:
            while not os.path.exists(port_file):
                self._check_alive_or_timeout(deadline, "writing its port file")
                time.sleep(0.05)
            with open(port_file) as f:
                self.port = int(f.read().strip())
            host = f"[{self._host}]" if ":" in self._host else self._host
            self.url = f"http://{host}:{self.port}"
            kw = dict(timeout_s=600.0, retries=3, backoff_s=0.5)
            kw.update(self._client_kwargs)
            self.client = SamplerClient(self.url, token=self._token, **kw)
            while True:
                self._check_alive_or_timeout(deadline, "answering /health")
                try:
                    self.client.health(retries=0)
                    return
                except SamplerError:
                    time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def _check_alive_or_timeout(self, deadline: float, what: str) -> None:
        if self.proc.poll() is not None:
            raise SamplerStartupError(f"sampler server exited with code {self.proc.returncode} before {what}; "
                                      f"output tail:\n{_tail(self._log_path)}")
        if time.monotonic() > deadline:
            raise SamplerStartupError(f"sampler server not {what} after {self._startup_timeout_s:.0f} s; "
                                      f"output tail:\n{_tail(self._log_path)}")

    def alive(self) -> bool:
        """True while the subprocess runs."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; closes the client; removes the process's temporary
        directory (port file and log) unless the server had died on its own (`_remove_workdir`). Idempotent."""
        if self.client is not None:
            self.client.close()
        crashed = self.proc is not None and self.proc.poll() not in (None, 0)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._remove_workdir(crashed)

    def kill(self) -> None:
        """SIGKILLs the subprocess (also a stopped one, which would never act on SIGTERM), closes the client and
        removes its temporary directory (`stop`)."""
        if self.client is not None:
            self.client.close()
        crashed = self.proc is not None and self.proc.poll() not in (None, 0)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._remove_workdir(crashed)

    def _remove_workdir(self, crashed: bool) -> None:
        """Removes the ``pdm_sampler_*`` temporary directory; a server that died on its own keeps its log there
        for a post-mortem (its path logged)."""
        path, self._workdir = getattr(self, "_workdir", None), None
        if not path:
            return
        if crashed:
            logging.getLogger(__name__).warning("sampler server exited with code %s; its log is kept at %s",
                                                self.proc.returncode, self._log_path)
            return
        shutil.rmtree(path, ignore_errors=True)

    def restart(self) -> "SamplerProcess":
        """Stops the process and starts it again with the same flags (a new port); returns self."""
        self.stop()
        self._start()
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """How the server process runs, beside what its engine does (`EngineSpec`).

    Attributes:
      host, port: where it binds (loopback by default; port 0 lets the OS pick one).
      startup_timeout_s: seconds to wait for its port file and ``/health``.
      compile_cache_dir: JAX persistent compilation cache directory ("" = none);
        compile_cache_min_compile_time_s: programs compiling faster than this (s) are not cached.
      reuse_freed_host_memory: passes ``--reuse_freed_host_memory`` (`pdm_jax.host_memory`).
      max_body_bytes: the server's ``--max_body_bytes`` (None: its default).
      extra_args: more server flags, appended as given.
      env: the process's environment (None: this process's, inherited).
    """

    host: str = "127.0.0.1"
    port: int = 0
    startup_timeout_s: float = 120.0
    compile_cache_dir: str = ""
    compile_cache_min_compile_time_s: float = 0.0
    reuse_freed_host_memory: bool = False
    max_body_bytes: Optional[int] = None
    extra_args: Sequence[str] = ()
    env: Optional[Mapping[str, str]] = None

    def to_argv(self) -> list:
        """The server flags of these options (the port file and the parent's pid are the launcher's own)."""
        argv = [f"--compile_cache_dir={self.compile_cache_dir}",
                f"--compile_cache_min_compile_time_s={float(self.compile_cache_min_compile_time_s)}",
                f"--host={self.host}", f"--port={int(self.port)}"]
        argv += ["--reuse_freed_host_memory"] if self.reuse_freed_host_memory else []
        argv += [] if self.max_body_bytes is None else [f"--max_body_bytes={int(self.max_body_bytes)}"]
        return argv + list(self.extra_args)


def _split_settings(spec: Optional[EngineSpec], options: Optional[ServerOptions], settings: dict):
    """``(spec, options)`` with `settings` (names of `EngineSpec` or `ServerOptions` fields) replacing theirs.

    Raises:
      TypeError: a name of neither.
      ValueError: an engine-only `EngineSpec` field off its default (the server has no flag for it), or a bad
        value (`EngineSpec`).
    """
    engine_names = {f.name for f in dataclasses.fields(EngineSpec)}
    option_names = {f.name for f in dataclasses.fields(ServerOptions)}
    unknown = sorted(set(settings) - engine_names - option_names)
    if unknown:
        raise TypeError(f"start_sampler_server: unknown setting(s) {unknown}")
    spec = dataclasses.replace(spec or EngineSpec(quantization="fp8"),
                               **{k: v for k, v in settings.items() if k in engine_names})
    options = dataclasses.replace(options or ServerOptions(),
                                  **{k: v for k, v in settings.items() if k in option_names})
    off = {k: v for k, v in spec.engine_only().items() if v != getattr(EngineSpec(), k)}
    if off:
        raise ValueError(f"start_sampler_server: the server has no flag for {sorted(off)}; got {off}")
    return spec, options


def start_sampler_server(spec: Optional[EngineSpec] = None, *, model_config: str, weights: Optional[str],
                         checkpoint_root: str, version: int = 0, token: Optional[str] = None,
                         options: Optional[ServerOptions] = None, client_kwargs: Optional[dict] = None,
                         **settings) -> SamplerProcess:
    """Starts ``python -m pdm_jax.sampler.server`` and waits for ``/health``.

    Args:
      spec: the engine's settings (`EngineSpec`; default: its defaults with fp8 weights, as the server's flags);
        its flag fields become the server's flags (`EngineSpec.to_argv`).
      model_config: the HF config.json (or its directory); `weights` None starts from a random init.
      checkpoint_root: the only directory ``/v1/weights`` loads from; `version`: the weights' version.
      token: the shared bearer token, passed through the environment (never argv).
      options: how the process runs (`ServerOptions`: host, port, start-up timeout, compile cache, environment, ...).
      client_kwargs: go to `SamplerClient` (timeout_s, retries, backoff_s).
      settings: `EngineSpec` or `ServerOptions` fields replacing those of `spec` / `options`.
    Returns:
      SamplerProcess (``.url``, ``.client``, ``.stop()``, ``.alive()``, ``.restart()``).
    Raises:
      SamplerStartupError: the process exited or did not answer within
        the start-up timeout; the message holds its output tail.
      TypeError / ValueError: a setting of neither record, or a bad value (`_split_settings`).
    """
    spec, options = _split_settings(spec, options, settings)
    argv = [sys.executable, "-m", "pdm_jax.sampler.server", f"--model_config={model_config}",
            f"--version={int(version)}", *spec.to_argv(), f"--checkpoint_root={checkpoint_root}",
            f"--parent_pid={os.getpid()}"]  # the server exits if this process dies (even by SIGKILL)
    if weights:
        argv.append(f"--weights={weights}")
    argv += options.to_argv()
    return SamplerProcess(argv, host=options.host, token=token, startup_timeout_s=options.startup_timeout_s,
                          client_kwargs=client_kwargs, env=None if options.env is None else dict(options.env))
