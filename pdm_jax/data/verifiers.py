"""Math answer verification with `math-verify`, safe from any thread.

`math_verify.parse` / `math_verify.verify` (Hugging Face, v0.9) enforce their
timeouts with `signal.alarm`, which only works in the main thread of the main
interpreter: called from another thread they raise ValueError. This module
never uses those internal timeouts. Instead:

* in the main thread (and when no other ITIMER_REAL timer is armed) the whole
  parse + parse + verify runs under one `signal.setitimer` budget of
  `timeout_s` seconds (float precision);
* in any other thread the call is shipped to a small process pool (spawn
  context). Each pool worker runs tasks in *its* main thread, so it applies the
  same itimer budget; the caller additionally waits at most
  `timeout_s + HARD_TIMEOUT_GRACE_S` and, if a worker is stuck where signals
  cannot interrupt it, terminates the pool (a fresh one is created on the next
  call).

A timeout, a parse failure or any exception gives reward 0.0 and is counted
per reason (`verifier_counts()`); `math_verdict` also returns the reason.

Answer extraction (`extract_final_answer`): the last `\\boxed{...}` (or
`\\fbox{...}`), else the last `#### x` line, else the last `Answer: x` line
(DAPO-Math-17k's requested format). Completions with none of these score 0
(reason "no_answer"): math-verify's own free-text extraction is deliberately
not used on the whole completion, so that listing many numbers cannot match.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import os
import re
import signal
import threading
from typing import Optional

HARD_TIMEOUT_GRACE_S = 2.0
# Seconds allowed for a fresh worker pool to start (spawn + importing sympy).
POOL_START_TIMEOUT_S = 120.0

REASONS = ("correct", "wrong", "no_answer", "unparsable_answer", "unparsable_gold", "timeout", "error")

_counts_lock = threading.Lock()
_counts: collections.Counter = collections.Counter()

_pool_lock = threading.Lock()
_pool = None
_pool_workers = max(1, min(4, os.cpu_count() or 1))


@dataclasses.dataclass(frozen=True)
class MathVerdict:
    """Result of one math verification.

    Attributes:
      reward: 1.0 if the extracted answer is equivalent to the ground truth, else 0.0.
      reason: one of REASONS.
      extracted: the extracted answer string (None when nothing was extracted).
    """

    reward: float
    reason: str
    extracted: Optional[str]


# ---------------------------------------------------------------------------
# Extraction.
# ---------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_RE = re.compile(r"answer[ \t]*:[ \t]*([^\n]*)", re.IGNORECASE)


def last_boxed_content(text: str) -> Optional[str]:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` with balanced braces.

    Also accepts the brace-less `\\boxed 3` form (one whitespace-free token).
    Returns None when there is no complete box."""
    if not isinstance(text, str):
        return None
    for match in reversed(list(_BOX_RE.finditer(text))):
        pos = match.end()
        if pos < len(text) and text[pos] == "{":
            depth = 0
            for end in range(pos, len(text)):
                char = text[end]
                if char == "{":
                    depth += 1
                elif char == "}":
                    depth -= 1
                    if depth == 0:
                        return text[pos + 1 : end]
            continue  # unbalanced: try an earlier box
        token = re.match(r"[^\s$]+", text[pos:])
        if match.group(0).endswith((" ", "\t")) and token:
            return token.group(0)
    return None


def _clean_inline(answer: str) -> str:
    answer = answer.strip()
    # Drop surrounding math delimiters and a trailing full stop: "$\frac12$." -> "\frac12".
    answer = answer.rstrip(".").strip()
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if answer.startswith(left) and answer.endswith(right) and len(answer) >= len(left) + len(right):
            answer = answer[len(left) : len(answer) - len(right)].strip()
    return answer


def extract_final_answer(text: str) -> Optional[str]:
    """Final answer string of a completion (see module docstring); None if absent.

    Examples: "so \\boxed{\\frac{1}{2}}." -> "\\frac{1}{2}"; "...\\n#### 1,234" ->
    "1,234"; "Answer: $7$" -> "7"; "I think 7" -> None."""
    if not isinstance(text, str):
        return None
    boxed = last_boxed_content(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_HASH_RE, _ANSWER_RE):
        found = pattern.findall(text)
        if found:
            answer = _clean_inline(found[-1])
            if answer:
                return answer
    return None


# ---------------------------------------------------------------------------
# Verification core (runs in a main thread: the caller's or a pool worker's).
# ---------------------------------------------------------------------------


class _Timeout(Exception):
    pass


def _raise_timeout(signum, frame):  # signal handler
    raise _Timeout()


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its own timeout is disabled; we enforce ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_filter_installed = False


def _import_math_verify():
    global _filter_installed
    import math_verify

    if not _filter_installed:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
        _filter_installed = True
    return math_verify


def _parse(math_verify, answer: str):
    """Parse `answer` as the content of a box (so that it is the anchored match)."""
    parsed = math_verify.parse("\\boxed{" + answer + "}", parsing_timeout=None, raise_on_error=True)
    if not parsed:
        parsed = math_verify.parse(answer, parsing_timeout=None, raise_on_error=True)
    return parsed


def _verdict_unbounded(completion: str, ground_truth: str) -> MathVerdict:
    math_verify = _import_math_verify()
    extracted = extract_final_answer(completion)
    if extracted is None or not extracted:
        return MathVerdict(0.0, "no_answer", None)
    gold_text = extract_final_answer(ground_truth) or ground_truth.strip()
    gold = _parse(math_verify, gold_text)
    if not gold:
        return MathVerdict(0.0, "unparsable_gold", extracted)
    pred = _parse(math_verify, extracted)
    if not pred:
        return MathVerdict(0.0, "unparsable_answer", extracted)
    ok = math_verify.verify(gold, pred, timeout_seconds=None, raise_on_error=False)
    return MathVerdict(1.0 if ok else 0.0, "correct" if ok else "wrong", extracted)


def _verdict_with_itimer(completion: str, ground_truth: str, timeout_s: float) -> MathVerdict:
    """Main-thread only: the whole verification under one ITIMER_REAL budget."""
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return _verdict_unbounded(completion, ground_truth)
    except _Timeout:
        return MathVerdict(0.0, "timeout", None)
    except Exception:
        return MathVerdict(0.0, "error", None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)


def _worker_verdict(completion: str, ground_truth: str, timeout_s: float) -> MathVerdict:
    """Pool task: pool workers run tasks in their main thread, so signals work."""
    return _verdict_with_itimer(completion, ground_truth, timeout_s)


def _worker_ready() -> bool:
    _import_math_verify()
    return True


def _can_use_signals() -> bool:
    if threading.current_thread() is not threading.main_thread():
        return False
    if not hasattr(signal, "setitimer"):
        return False
    try:
        # Someone else's alarm is armed: do not clobber it.
        return signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    except Exception:
        return False


def _get_pool():
    global _pool
    with _pool_lock:
        if _pool is None:
            context = multiprocessing.get_context("spawn")
            pool = context.Pool(processes=_pool_workers)
            try:
                pool.apply_async(_worker_ready).get(timeout=POOL_START_TIMEOUT_S)
            except Exception:
                pool.terminate()
                raise
            _pool = pool
        return _pool


def _discard_pool(pool) -> None:
    global _pool
    with _pool_lock:
        if _pool is pool:
            _pool = None
    pool.terminate()


def set_pool_workers(num_workers: int) -> None:
    """Number of worker processes used for off-main-thread calls (default min(4, cpus)).

    Takes effect for the next pool created; the current pool is closed."""
    global _pool_workers
    if int(num_workers) < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers!r}")
    _pool_workers = int(num_workers)
    shutdown_pool()


def shutdown_pool() -> None:
    """Terminate the worker pool, if any (also registered at interpreter exit)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.terminate()


import atexit  # noqa: E402

atexit.register(shutdown_pool)


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def _count(reason: str) -> None:
    with _counts_lock:
        _counts[reason] += 1


def verifier_counts() -> dict[str, int]:
    """Process-wide counts of `math_verdict` outcomes by reason (all REASONS keys)."""
    with _counts_lock:
        return {reason: int(_counts[reason]) for reason in REASONS}


def reset_verifier_counts() -> None:
    with _counts_lock:
        _counts.clear()


def math_verdict(completion: str, ground_truth: str, *, timeout_s: float = 5.0) -> MathVerdict:
    """Verify a math completion against a ground-truth answer; never raises on bad input.

    Args:
      completion: model output text; the final answer is taken from the last
        `\\boxed{}`, `#### x` or `Answer: x` (see `extract_final_answer`).
      ground_truth: reference answer, e.g. "72", "\\frac{1}{2}" (a "#### x" or
        boxed ground truth is unwrapped the same way).
      timeout_s: wall-clock budget in seconds for parsing and comparing
        (> 0). Off the main thread the hard limit is timeout_s +
        HARD_TIMEOUT_GRACE_S plus the one-off pool start-up.

    Returns:
      MathVerdict(reward in {0.0, 1.0}, reason in REASONS, extracted answer).
      Equivalence is math-verify's (`verify(parse(gold), parse(pred))`, float
      rounding 6 digits): 1/2 == 0.5 == \\frac{1}{2}, "1,000" == 1000.

    Raises:
      ValueError: timeout_s is not a positive number.
    """
    try:
        timeout_s = float(timeout_s)
    except (TypeError, ValueError):
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}") from None
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    if not isinstance(completion, str) or not isinstance(ground_truth, str):
        verdict = MathVerdict(0.0, "error", None)
    elif _can_use_signals():
        verdict = _verdict_with_itimer(completion, ground_truth, timeout_s)
    else:
        verdict = _verdict_in_pool(completion, ground_truth, timeout_s)
    _count(verdict.reason)
    return verdict


def _verdict_in_pool(completion: str, ground_truth: str, timeout_s: float) -> MathVerdict:
    try:
        pool = _get_pool()
    except Exception:
        return MathVerdict(0.0, "error", None)
    try:
        result = pool.apply_async(_worker_verdict, (completion, ground_truth, timeout_s))
        return result.get(timeout=timeout_s + HARD_TIMEOUT_GRACE_S)
    except multiprocessing.TimeoutError:
        _discard_pool(pool)
        return MathVerdict(0.0, "timeout", None)
    except Exception:
        return MathVerdict(0.0, "error", None)


def math_reward(completion: str, ground_truth: str, *, timeout_s: float = 5.0) -> float:
    """`math_verdict(...).reward`: 1.0 if equivalent, 0.0 otherwise (incl. timeout/parse failure).

    Safe to call from any thread; outcomes are counted in `verifier_counts()`."""
    return math_verdict(completion, ground_truth, timeout_s=timeout_s).reward
