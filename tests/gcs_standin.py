"""A local stand-in for a GCS bucket: gcp-storage-emulator (PyPI) on a loopback port, in memory.

`start_emulator()` starts ``gcp-storage-emulator start --in-memory`` on 127.0.0.1 and
returns ``(process, env)``; ``env`` points every client of the run at it:

* gcsfs (fsspec ``gs://``: our run files, and orbax's metadata through etils.epath)
  by ``STORAGE_EMULATOR_HOST`` (anonymous access; ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``
  skips gcsfs' bucket-type probe, a gRPC call the emulator does not serve);
* TensorStore's GCS driver (orbax's arrays) by ``TENSORSTORE_GCS_HTTP_URL``, with a
  fixed test token (``GOOGLE_AUTH_TOKEN_FOR_TESTING``) so that it asks no credential
  server; the metadata-server variables point at a closed loopback port, so nothing
  leaves the machine.

One fix to the emulator (`_patch`, applied when this file runs it as a script): its
media downloads lack the ``x-goog-generation`` header real GCS sends, so TensorStore
read generation 0 and refused its own conditional rewrite of an OCDBT manifest
("Malformed StorageGeneration"); the patched download adds the object's generation
and metageneration headers. The emulator does not enforce ``ifGenerationMatch``
preconditions (GCS does): a run has one writer per object, so none is needed here.

What the stand-in does not exercise: real GCS consistency and latency, rate limits
(429s on an object rewritten more than once a second), authentication, the
storage-control API (hierarchical / zonal buckets), and several hosts with
separate disks (the processes of a test share this machine).
"""

import os
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emulator_env(port: int) -> dict:
    """The environment variables that point gcsfs and TensorStore at the emulator on `port`."""
    url = f"http://127.0.0.1:{port}"
    closed = f"127.0.0.1:{_free_port()}"
    return dict(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
                GOOGLE_AUTH_TOKEN_FOR_TESTING="standin-token", GCE_METADATA_ROOT=closed, GCE_METADATA_HOST=closed,
                GCE_METADATA_IP=closed, NO_GCE_CHECK="True")


def start_emulator(bucket: str = "pdm-standin"):
    """Starts the (patched) emulator, creates `bucket`; returns ``(Popen, env)``. Stop it with ``proc.kill()``."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(port), bucket],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"gcp-storage-emulator did not come up on port {port}")
            time.sleep(0.2)
    return proc, emulator_env(port)


def _patch() -> None:
    """Media downloads carry the object's generation headers, as GCS's do (see module docstring)."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    original = objects.download

    def download(request, response, storage, *args, **kwargs):
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = str(obj["generation"])
            response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
        except Exception:  # noqa: BLE001 - a missing object: the original handler answers 404
            pass
        return original(request, response, storage, *args, **kwargs)

    objects.download = download  # objects.get (JSON API, alt=media) calls it by this name
    for _, handlers in server.HANDLERS:
        for method, fn in list(handlers.items()):
            if fn is original:
                handlers[method] = download


if __name__ == "__main__":  # python tests/gcs_standin.py PORT BUCKET: the patched emulator, in memory
    _patch()
    from gcp_storage_emulator.server import create_server

    create_server("127.0.0.1", int(sys.argv[1]), in_memory=True, default_bucket=sys.argv[2]).run()
