"""The one line a worker prints on Ctrl-C (bps_gossip.logs.interrupt_summary): the user's line
and the library's, never a compiled extension's frame taken for the user's."""

from __future__ import annotations

import types

import pytest

from bps_gossip.logs import interrupt_summary

pytestmark = pytest.mark.unit


def _traceback(*places: tuple[str, int, str]) -> types.TracebackType:
    """A real traceback through code objects that claim ``places`` (file, line, function)."""
    tb = None
    for filename, line, name in reversed(places):
        source = "\n" * (line - 1) + "raise KeyboardInterrupt"
        code = compile(source, filename, "exec").replace(co_name=name)
        try:
            exec(code, {})
        except KeyboardInterrupt as interrupt:
            frame_tb = interrupt.__traceback__.tb_next  # the frame of ``code``
            tb = types.TracebackType(tb, frame_tb.tb_frame, frame_tb.tb_lasti, frame_tb.tb_lineno)
    return tb


def test_a_frame_of_a_compiled_extension_is_not_the_users(tmp_path):
    """Ctrl-C landed inside pyzmq's send while rank 1 pushed from its loop (seen in CI): the line
    named pyzmq's 'zmq/backend/cython/_zmq.py:179' as the user's."""
    import bps_gossip.transport.framing as framing

    script = tmp_path / "train.py"
    script.write_text("\n" * 20)
    tb = _traceback((str(script), 12, "<module>"), (framing.__file__, 61, "send_message"),
                    ("zmq/backend/cython/_zmq.py", 179, "send"))
    line = interrupt_summary(KeyboardInterrupt(), tb, "rank 1")
    assert f"at {script}:12" in line or "at train.py:12" in line, line
    assert "waiting in bps_gossip/transport/framing.py:61 (send_message)" in line, line
    assert "_zmq.py" not in line, line
