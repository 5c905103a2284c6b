"""What a failing test shows of a vLLM child's output: the first exception (the root cause) and the tail.

A vLLM engine that fails to start prints the original traceback first and then pages of follow-on errors (the engine
core's death, the front end's "Engine core initialization failed", shutdown noise), so the last few thousand
characters often hold only the consequences. Engine-core and worker lines carry a prefix such as
``(EngineCore_DP0 pid=123) `` on every line of their traceback; it is kept as it is.
"""

from __future__ import annotations

TRACEBACK = "Traceback (most recent call last):"


def root_cause(text: str, limit: int = 4000) -> str:
    """The first traceback in ``text``, from its header to its exception line (at most ``limit`` characters, the
    exception line always kept), or '' when there is none."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        at = line.find(TRACEBACK)
        if at < 0:
            continue
        prefix = line[:at]
        block = [line]
        for nxt in lines[i + 1:]:
            body = nxt[len(prefix):] if nxt.startswith(prefix) else None
            if body is None:
                continue  # another process's line interleaved
            block.append(nxt)
            if body and not body[0].isspace():  # the exception line ends the traceback
                break
        out = "\n".join(block)
        if len(out) > limit:
            out = out[:limit // 2] + "\n[...]\n" + out[-(limit // 2):]
        return out
    return ""


def excerpt(text: str, tail: int = 6000) -> str:
    """The first exception (if any) and the last ``tail`` characters: what an assertion message should carry."""
    cause = root_cause(text)
    end = text[-tail:]
    if not cause or cause in end:
        return end
    return f"first exception in the output:\n{cause}\n--- last {tail} characters ---\n{end}"
