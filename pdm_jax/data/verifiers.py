"""Math answer verification with `math-verify` (Hugging Face, v0.9), safe from any thread.

math-verify's own timeouts use `signal.alarm` (main thread only, and no help against a long C-level computation such
as `\\boxed{9^{9^{9^{9}}}}`), so they are never used: by default (`in_process=False`) the verification runs in a
lazily started worker subprocess (JSON lines over pipes) under a `signal.setitimer` budget of `timeout_s`, and the
caller kills a worker that misses `timeout_s + HARD_TIMEOUT_GRACE_S`; `in_process=True` runs in the calling thread
(soft budget in the main thread only; trusted inputs). A timeout, a parse failure or any exception scores 0.0,
counted per reason (`verifier_counts()`). The final answer is found by `find_final_answer` (after `</think>`; the
later of the last `\\boxed{}` and the last `Answer:` line, else a numeric `#### N` line; a cut-off answer scores 0,
reason "truncated"); exact numbers are compared exactly before math-verify's own comparison."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

HARD_TIMEOUT_GRACE_S = 2.0
# Seconds allowed for a fresh worker process to start (python + importing sympy).
POOL_START_TIMEOUT_S = 120.0

REASONS = ("correct", "wrong", "no_answer", "truncated", "unparsable_answer", "unparsable_gold", "timeout",
           "error")

_counts_lock = threading.Lock()
_counts: collections.Counter = collections.Counter()

_pool_lock = threading.Lock()
_pool = None
_pool_workers = max(1, min(4, os.cpu_count() or 1))


@dataclasses.dataclass(frozen=True)
class MathVerdict:
    """Result of one math verification: ``reward`` (1.0 if the extracted answer is equivalent to the ground truth, else
    0.0), ``reason`` (one of REASONS), ``extracted`` (the extracted answer, or None)."""

    reward: float
    reason: str
    extracted: Optional[str]


# ---- Extraction. -----------------------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*")
# "Answer:", "Final answer:", "**Answer:**", "**Answer**:", "*Final Answer*:" anywhere in a line (the emphasis around
# the marker is part of it).
_ANSWER_MARKER_RE = re.compile(
    r"(?P<o1>\*\*|__|\*|_)(?:final[ \t]+)?answer[ \t]*:[ \t]*(?P=o1)"
    r"|(?P<o2>\*\*|__|\*|_)(?:final[ \t]+)?answer[ \t]*(?P=o2)[ \t]*:"
    r"|(?<![A-Za-z])(?:final[ \t]+)?answer[ \t]*:", re.IGNORECASE)
# A line that is only an answer heading ("## Final Answer", "**Answer**", "Answer"): see `_answer_headings`.
_HEADING_WORDS = ("answer", "final answer", "the answer", "the final answer")
_HASH_RE = re.compile(r"#{4,}[ \t]*([^\n]*)")
_NUMBER_RE = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:/\d+)?")
# Balanced wrappers unwrapped around an answer, longest first: display/inline math, emphasis, code.
_WRAPPERS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"), ("**", "**"), ("__", "__"),
             ("*", "*"), ("_", "_"), ("`", "`"))
_MATH_DELIMITERS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))

FOUND, ABSENT, TRUNCATED = "found", "absent", "truncated"


@dataclasses.dataclass(frozen=True)
class Extraction:
    """What `find_final_answer` found: ``answer`` (None unless FOUND), ``status`` (FOUND, ABSENT, or TRUNCATED: an
    unclosed last box, math delimiter or brace, or an unended final line of a max_tokens completion) and ``marker``
    ("boxed", "answer_line", "hash_line" or None)."""

    answer: Optional[str]
    status: str
    marker: Optional[str] = None


def _answer_headings(text: str) -> list[tuple[int, int]]:
    """(start, end) of the lines that are only an answer heading: optional `>` and `#`s, emphasis, one of _HEADING_WORDS
    (any case, any spacing), an optional colon. Linear time (no regex backtracking)."""
    found, start = [], 0
    for line in text.split("\n"):
        end = start + len(line)
        if len(line) < 64 and "nswer" in line.lower():
            core = line.strip().lstrip(">").strip().lstrip("#").strip().strip("*_").strip()
            core = core.rstrip(":").strip().strip("*_").strip().rstrip(":").strip()
            if " ".join(core.lower().split()) in _HEADING_WORDS:
                found.append((start, end))
        start = end + 1
    return found


def _last_box(text: str, truncated: bool) -> Extraction:
    """The last `\\boxed{...}` / `\\fbox{...}` (or brace-less `\\boxed 3`) of `text`."""
    matches = list(_BOX_RE.finditer(text))
    for match in reversed(matches):
        pos = match.end()
        if pos < len(text) and text[pos] == "{":
            depth = 0
            for end in range(pos, len(text)):
                if text[end] == "{":
                    depth += 1
                elif text[end] == "}":
                    depth -= 1
                    if depth == 0:
                        return Extraction(text[pos + 1 : end].strip(), FOUND, "boxed")
            return Extraction(None, TRUNCATED, "boxed")  # the last box never closes: cut off
        token = re.match(r"[^\s$]+", text[pos:])
        if match.group(0).endswith((" ", "\t")) and token:
            if truncated and pos + token.end() == len(text):
                return Extraction(None, TRUNCATED, "boxed")
            return Extraction(token.group(0), FOUND, "boxed")
    return Extraction(None, ABSENT)


def last_boxed_content(text: str) -> Optional[str]:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (balanced braces, or the brace-less `\\boxed 3`); None without
    a box or when the last box never closes."""
    if not isinstance(text, str):
        return None
    return _last_box(text, truncated=False).answer


def unwrap_answer(answer: str) -> tuple[str, bool]:
    """`(text, closed)`: `answer` stripped of balanced wrappers (`$x$`, `$$x$$`, `\\(x\\)`, `\\[x\\]`, `**x**`, `__x__`,
    `*x*`, `_x_`, `` `x` ``, outermost first) and whitespace; closed is True if a wrapper was removed."""
    closed = False
    answer = answer.strip()
    changed = True
    while changed:
        changed = False
        for left, right in _WRAPPERS:
            if (len(answer) > len(left) + len(right) and answer.startswith(left) and answer.endswith(right)
                    and answer[len(left) : len(answer) - len(right)].strip()):
                answer = answer[len(left) : len(answer) - len(right)].strip()
                closed = changed = True
                break
    return answer, closed


def _math_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, inner text) of the math spans `$$x$$`, `\\[x\\]`, `\\(x\\)`, `$x$` of `text`, left to right; stops
    at the first span that does not close (linear time: str.find only)."""
    spans, pos = [], 0
    next_open = dict.fromkeys(left for left, _ in _MATH_DELIMITERS)  # each opener's next index (-1: none left)
    while True:
        opened = []
        for left, right in _MATH_DELIMITERS:
            if next_open[left] is None or 0 <= next_open[left] < pos:
                next_open[left] = text.find(left, pos)
            if next_open[left] >= pos:
                opened.append((next_open[left], -len(left), left, right))
        if not opened:
            return spans
        start, _, left, right = min(opened)  # the earliest opener, the longest one at a tie ($$ before $)
        end = text.find(right, start + len(left))
        if end < 0:
            return spans
        spans.append((start, end + len(right), text[start + len(left) : end]))
        pos = end + len(right)


def _is_cut(answer: str) -> bool:
    """An answer that opens more than it closes: a brace, `\\(`, `\\[` or `$$` (cut off inside it)."""
    return (answer.count("{") > answer.count("}") or answer.count("\\(") > answer.count("\\)")
            or answer.count("\\[") > answer.count("\\]") or answer.count("$$") % 2 == 1)


def _clean_line(raw: str) -> tuple[str, bool]:
    """A marker line's answer: a trailing full stop, balanced wrappers, a currency `$` and, when the answer is prose
    around inline math, the prose removed; the closer of a math block the marker sat in (`\\[Answer: 5\\]`) and the `}`
    of a `\\text{Answer:}` dropped. Returns (answer, closed)."""
    answer = raw.strip()
    if answer.startswith("}"):  # the marker was inside \text{Answer: }
        answer = answer[1:].strip()
    for opener, closer in (("\\[", "\\]"), ("\\(", "\\)"), ("$$", "$$"), ("$", "$")):
        body = answer[: -len(closer)] if answer.endswith(closer) else None
        if body is not None and opener not in body and (closer != "$" or "$" not in body):
            answer = body.strip()  # the block closes after the answer; its opener came before the marker
            break
    answer = answer.rstrip(".").strip()
    answer, closed = unwrap_answer(answer)
    answer = answer.rstrip(".").strip()
    spans = _math_spans(answer)
    outside = "".join(answer[a:b] for a, b in zip([0] + [end for _, end, _ in spans],
                                                 [start for start, _, _ in spans] + [len(answer)]))
    if spans and re.search(r"[A-Za-z]{2,}", outside):
        answer, closed = spans[-1][2].strip(), True  # "the total is $42$ dollars" -> "42"
    if answer.count("$") == 1 and re.match(r"\$\s*[-+]?[\d.]", answer):
        answer = answer.replace("$", "", 1).strip()  # "$1,250": a currency sign, not math
    return answer, closed


def _marker_answer(text: str, start: int, truncated: bool, marker: str) -> Extraction:
    """The answer after a marker ending at `start`: the rest of its line, or, when that is empty, the next non-empty
    line; a display block (`$$`, `\\[`) opened there extends to its closing delimiter."""
    rest = text[start:]
    first_line = rest.split("\n", 1)[0]
    if not _clean_line(first_line)[0]:
        following = re.search(r"\n[ \t]*(?=\S)", rest)
        if following is None:
            return Extraction(None, TRUNCATED if truncated else ABSENT, marker)
        rest = rest[following.end() :]
    body = rest.lstrip(" \t*_")
    for left, right in (("$$", "$$"), ("\\[", "\\]")):
        if body.startswith(left) and right not in body.split("\n", 1)[0][len(left) :]:
            close = body.find(right, len(left))
            if close < 0:
                return Extraction(None, TRUNCATED, marker)
            answer = unwrap_answer(body[: close + len(right)])[0]
            return Extraction(answer, FOUND, marker) if answer and not _is_cut(answer) else \
                Extraction(None, TRUNCATED if _is_cut(answer) else ABSENT, marker)
    line, newline, _ = rest.partition("\n")
    answer, closed = _clean_line(line)
    if _is_cut(answer) or (truncated and not newline and not closed):
        return Extraction(None, TRUNCATED, marker)
    return Extraction(answer, FOUND, marker) if answer else Extraction(None, ABSENT, marker)


def _hash_answer(text: str, truncated: bool) -> Extraction:
    """The last `#### N` (four or more #) line whose content is a number (a GSM8K final answer)."""
    for match in reversed(list(_HASH_RE.finditer(text))):
        answer, closed = _clean_line(match.group(1))
        if _NUMBER_RE.fullmatch(answer):
            if truncated and match.end() == len(text) and not closed:
                return Extraction(None, TRUNCATED, "hash_line")
            return Extraction(answer, FOUND, "hash_line")
    return Extraction(None, ABSENT)


def find_final_answer(text: str, *, truncated: bool = False) -> Extraction:
    """The final answer of a free-form completion, with how it was found.

    With a `</think>` only the text after the last one is graded; a `<think>` that never closes leaves nothing
    (ABSENT, or TRUNCATED for a max_tokens completion, marker "think"). Then, "last" by position:

    1. the last `\\boxed{...}` / `\\fbox{...}` (also `\\boxed 3`, also inside math delimiters), unless an answer
      marker comes after it; a last box that never closes is TRUNCATED;
    2. else the last answer marker: `Answer:` anywhere in a line (any case, `Final answer:`, markdown emphasis around
      the word or colon) or an answer heading line (`## Final Answer`, `**Answer**`); the answer is the rest of the
      line or the next non-empty line, a display block opened there running to its close;
    3. else the last `#### N` line (four or more `#`) whose content is a number (`-3`, `1,234`, `3/4`, `$1,250`);
    4. else ABSENT.

    Rules 2-3 drop balanced wrappers, a trailing full stop, a currency `$` and prose around inline math. An answer
    with an unclosed brace, `\\(`, `\\[` or `$$` is TRUNCATED, and with `truncated=True` so is one on the
    unterminated last line.

    Args:
      text: the completion (anything but a str is ABSENT).
      truncated: the completion hit the token budget (finish_reason "length").

    Returns:
      `Extraction(answer, status, marker)`."""
    if not isinstance(text, str):
        return Extraction(None, ABSENT)
    closed = text.rfind("</think>")
    if closed >= 0:
        text = text[closed + len("</think>"):]
    elif "<think>" in text:  # still reasoning: no answer yet (a box tried in there is not one)
        return Extraction(None, TRUNCATED if truncated else ABSENT, "think")
    markers = [(m.start(), m.end()) for m in _ANSWER_MARKER_RE.finditer(text)] + _answer_headings(text)
    boxes = list(_BOX_RE.finditer(text))
    if not markers or (boxes and boxes[-1].start() >= max(markers)[1]):  # no answer line after the last box
        boxed = _last_box(text, truncated)
        if boxed.status != ABSENT:
            return boxed
    if markers:
        return _marker_answer(text, max(markers)[1], truncated, "answer_line")
    return _hash_answer(text, truncated)


def extract_final_answer(text: str, *, truncated: bool = False) -> Optional[str]:
    """Final answer string of a completion (`find_final_answer`); None if absent or cut off. "so \\boxed{\\frac{1}{2}}."
    -> "\\frac{1}{2}"; "...\\n#### 1,234" -> "1,234"; "Answer: **73**" -> "73"; "I think 7" -> None; "so \\boxed{12"
    -> None."""
    return find_final_answer(text, truncated=truncated).answer


# ---- Verification core (runs in a main thread: the caller's or a pool worker's). -------------------------


class _Timeout(BaseException):
    """Raised by our SIGALRM handler. A BaseException so that math-verify's `except Exception` blocks cannot swallow it
    and report "wrong"."""


def _raise_timeout(signum, frame):  # signal handler
    raise _Timeout()


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its own timeout is disabled; we enforce ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_filter_installed = False


def _import_math_verify():
    global _filter_installed
    import math_verify  # heavy and only in the verifier worker processes

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


#: The largest exact number `_exact_equal` evaluates (decimal digits of a power or factorial).
MAX_EXACT_DIGITS = 100_000


def _exact_value(expr):
    """`expr` (a sympy expression) evaluated exactly to a Rational: integers and fractions combined by +, x, integer
    powers and factorials; None when it holds anything else (symbols, floats, roots, functions) or would grow past
    `MAX_EXACT_DIGITS` decimal digits (checked before each power or factorial is taken)."""
    import sympy

    def digits(q) -> float:
        return math.log10(max(abs(int(q.p)), abs(int(q.q)), 2))

    def ev(node):
        if isinstance(node, sympy.Rational):  # Integer is a Rational
            return node
        if isinstance(node, sympy.Add):
            return sympy.Add(*[ev(a) for a in node.args])
        if isinstance(node, sympy.Mul):
            return sympy.Mul(*[ev(a) for a in node.args])
        if isinstance(node, sympy.Pow):
            base, exp = ev(node.args[0]), ev(node.args[1])
            if not exp.is_Integer or abs(int(exp)) * digits(base) > MAX_EXACT_DIGITS or (base == 0 and exp < 0):
                raise ValueError("not an exact power")
            return base ** exp
        if isinstance(node, sympy.factorial):
            n = ev(node.args[0])
            if not n.is_Integer or n < 0 or int(n) > MAX_EXACT_DIGITS // 5:
                raise ValueError("not an exact factorial")
            return sympy.factorial(int(n))
        raise ValueError(f"not exact: {type(node).__name__}")

    try:
        value = ev(expr)
    except (ValueError, TypeError, ZeroDivisionError):
        return None
    return value if isinstance(value, sympy.Rational) else None


def _exact_equal(gold, pred, gold_text: str, pred_text: str) -> Optional[bool]:
    """Both answers exact numbers (integers, fractions, integer powers and factorials; no decimals, no symbols): their
    exact equality; else None (math-verify decides). math-verify's numeric check rounds to ~1e-16 and equates 1/2006!
    with 1/2004!, or 1/2^98 with 1/2^99. Decimals stay with math-verify (its rounding is how a decimal answer is
    judged)."""
    import sympy

    if "." in gold_text or "." in pred_text:
        return None

    def first(parsed):
        return next((x for x in parsed if isinstance(x, sympy.Basic)), None)

    g, p = first(gold), first(pred)
    if g is None or p is None:
        return None
    gv, pv = _exact_value(g), _exact_value(p)
    if gv is None or pv is None:
        return None
    return bool(gv == pv)


def _verdict_unbounded(completion: str, ground_truth: str, truncated: bool = False) -> MathVerdict:
    math_verify = _import_math_verify()
    found = find_final_answer(completion, truncated=truncated)
    if found.status == TRUNCATED:
        return MathVerdict(0.0, "truncated", None)
    extracted = found.answer
    if extracted is None or not extracted:
        return MathVerdict(0.0, "no_answer", None)
    gold_text = extract_final_answer(ground_truth) or ground_truth.strip()
    gold = _parse(math_verify, gold_text)
    if not gold:
        return MathVerdict(0.0, "unparsable_gold", extracted)
    pred = _parse(math_verify, extracted)
    if not pred:
        return MathVerdict(0.0, "unparsable_answer", extracted)
    ok = _exact_equal(gold, pred, gold_text, extracted)
    if ok is None:
        ok = math_verify.verify(gold, pred, timeout_seconds=None, raise_on_error=False)
    return MathVerdict(1.0 if ok else 0.0, "correct" if ok else "wrong", extracted)


def _verdict_with_itimer(completion: str, ground_truth: str, timeout_s: float,
                         truncated: bool = False) -> MathVerdict:
    """Main-thread only: the whole verification under one ITIMER_REAL budget (soft: the signal interrupts Python
    bytecode only)."""
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            return _verdict_unbounded(completion, ground_truth, truncated)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
    except _Timeout:  # also when the alarm lands just before it is cancelled
        return MathVerdict(0.0, "timeout", None)
    except Exception:
        return MathVerdict(0.0, "error", None)
    finally:
        signal.signal(signal.SIGALRM, previous)


# ---- Worker subprocesses for calls off the main thread ------------------------------------------------------------
# `python -c "...; _worker_main()"` speaking JSON lines; plain subprocesses, as multiprocessing's spawn re-imports the
# caller's __main__ (breaks stdin scripts and notebooks).

_WORKER_CODE = "from pdm_jax.data.verifiers import _worker_main; _worker_main()"


def _worker_main() -> None:
    """Entry point of a verifier worker process (JSON lines on stdin/stdout)."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1, encoding="utf-8")
    sys.stdout = sys.stderr  # nothing else may write to the protocol stream
    _import_math_verify()
    protocol.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        try:
            request = json.loads(line)
            verdict = _verdict_with_itimer(request["completion"], request["ground_truth"],
                                           float(request["timeout_s"]), bool(request.get("truncated", False)))
        except Exception:
            verdict = MathVerdict(0.0, "error", None)
        protocol.write(json.dumps(dataclasses.asdict(verdict)) + "\n")


class _Worker:
    """One verifier subprocess; not thread-safe (the pool hands it to one thread at a time)."""

    def __init__(self):
        import pdm_jax  # the worker's own package path

        env = dict(os.environ)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(pdm_jax.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self._buffer = b""
        ready = self._read_line(POOL_START_TIMEOUT_S)
        if ready is None:
            self.kill()
            raise RuntimeError("math-verify worker did not start")

    def _read_line(self, timeout_s: float) -> Optional[bytes]:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # worker died
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def call(self, completion: str, ground_truth: str, timeout_s: float,
             truncated: bool = False) -> Optional[MathVerdict]:
        """The worker's verdict, or None if it missed the hard deadline or died."""

        request = json.dumps({"completion": completion, "ground_truth": ground_truth, "timeout_s": timeout_s,
                              "truncated": bool(truncated)})
        try:
            self.proc.stdin.write(request.encode("utf-8") + b"\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        line = self._read_line(timeout_s + HARD_TIMEOUT_GRACE_S)
        if line is None:
            return None
        fields = json.loads(line)
        return MathVerdict(float(fields["reward"]), str(fields["reason"]), fields["extracted"])

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except Exception:
                pass


class _WorkerPool:
    """Up to `size` lazily started workers shared by all non-main threads."""

    def __init__(self, size: int):
        self.size = size
        self._idle: "queue.Queue[_Worker]" = queue.Queue()
        self._lock = threading.Lock()
        self._started = 0
        self._all: list[_Worker] = []

    def _acquire(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            start_new = self._started < self.size
            if start_new:
                self._started += 1
        if not start_new:
            return self._idle.get()
        try:
            worker = _Worker()
        except Exception:
            with self._lock:
                self._started -= 1
            raise
        with self._lock:
            self._all.append(worker)
        return worker

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._started -= 1
            if worker in self._all:
                self._all.remove(worker)

    def verdict(self, completion: str, ground_truth: str, timeout_s: float, truncated: bool = False) -> MathVerdict:
        worker = self._acquire()
        try:
            result = worker.call(completion, ground_truth, timeout_s, truncated)
        except Exception:
            result = None
            self._retire(worker)
            return MathVerdict(0.0, "error", None)
        if result is None:  # hard deadline missed (or worker died): kill it
            self._retire(worker)
            return MathVerdict(0.0, "timeout", None)
        self._idle.put(worker)
        return result

    def close(self) -> None:
        with self._lock:
            workers, self._all = list(self._all), []
        for worker in workers:
            worker.kill()


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


def _get_pool() -> _WorkerPool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _WorkerPool(_pool_workers)
        return _pool


def set_pool_workers(num_workers: int) -> None:
    """Number of worker processes for off-main-thread calls (default min(4, cpus)).

    Closes the current workers; new ones start on demand."""
    global _pool_workers
    if int(num_workers) < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers!r}")
    _pool_workers = int(num_workers)
    shutdown_pool()


def pool_workers() -> int:
    """The configured number of verifier worker processes."""
    return _pool_workers


def shutdown_pool() -> None:
    """Kill the worker processes, if any (also registered at interpreter exit)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.close()


import atexit  # noqa: E402

atexit.register(shutdown_pool)


# ---- Public API. -----------------------------------------------------------------------------------------


def _count(reason: str) -> None:
    with _counts_lock:
        _counts[reason] += 1


def verifier_counts() -> dict[str, int]:
    """Process-wide counts of `math_verdict` outcomes by reason (all REASONS keys)."""
    with _counts_lock:
        return {reason: int(_counts[reason]) for reason in REASONS}


def reset_verifier_counts() -> None:
    """Sets every verifier outcome counter (see `verifier_counts`) back to zero."""
    with _counts_lock:
        _counts.clear()


def math_verdict(
    completion: str, ground_truth: str, *, timeout_s: float = 5.0, in_process: bool = False,
    truncated: bool = False,
) -> MathVerdict:
    """Verify a math completion against a ground-truth answer; never raises on bad input.

    Args:
      completion: model output text (final answer by `find_final_answer`).
      ground_truth: reference answer, e.g. "72", "\\frac{1}{2}" ("#### x" or boxed is unwrapped alike).
      timeout_s: budget in seconds (> 0); the hard limit is timeout_s + HARD_TIMEOUT_GRACE_S (plus a worker's
        start-up).
      in_process: run in the calling thread instead of a worker subprocess.
      truncated: stopped by max_tokens: an answer on its unterminated last line gets no credit.

    Returns:
      MathVerdict(reward in {0.0, 1.0}, reason in REASONS, extracted answer); equivalence is math-verify's
      (`verify(parse(gold), parse(pred))`): 1/2 == 0.5 == \\frac{1}{2}, "1,000" == 1000.

    Raises:
      ValueError: timeout_s is not a positive number."""
    try:
        timeout_s = float(timeout_s)
    except (TypeError, ValueError):
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}") from None
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    if not isinstance(completion, str) or not isinstance(ground_truth, str):
        verdict = MathVerdict(0.0, "error", None)
    elif not in_process:
        verdict = _verdict_in_pool(completion, ground_truth, timeout_s, truncated)
    elif _can_use_signals():
        verdict = _verdict_with_itimer(completion, ground_truth, timeout_s, truncated)
    else:
        verdict = _verdict_no_timeout(completion, ground_truth, truncated)
    _count(verdict.reason)
    return verdict


def _verdict_no_timeout(completion: str, ground_truth: str, truncated: bool = False) -> MathVerdict:
    try:
        return _verdict_unbounded(completion, ground_truth, truncated)
    except Exception:
        return MathVerdict(0.0, "error", None)


def _verdict_in_pool(completion: str, ground_truth: str, timeout_s: float, truncated: bool = False) -> MathVerdict:
    try:
        return _get_pool().verdict(completion, ground_truth, timeout_s, truncated)
    except Exception:
        return MathVerdict(0.0, "error", None)


def math_reward(
    completion: str, ground_truth: str, *, timeout_s: float = 5.0, in_process: bool = False,
    truncated: bool = False,
) -> float:
    """`math_verdict(...).reward`: 1.0 if equivalent, 0.0 otherwise (incl. timeout/parse failure, a cut-off answer).

    Safe to call from any thread; outcomes are counted in `verifier_counts()`."""
    return math_verdict(completion, ground_truth, timeout_s=timeout_s, in_process=in_process,
                        truncated=truncated).reward
