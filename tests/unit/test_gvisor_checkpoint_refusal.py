"""How the gVisor engine reads a checkpoint its guest's TCP state refused (runsc's
own words, as runsc 20240729 printed them here), and the flag that resets a
sandbox's connections at a checkpoint instead."""

from __future__ import annotations

from pathlib import Path

from boxd.engine.gvisor._engine import Runsc, _error_head, checkpoint_refusal

_TRACE = """
goroutine 126 [running]:
gvisor.dev/gvisor/pkg/state.safely.func1()
\tgvisor.dev/gvisor/pkg/state/state.go:309 +0x179
{frame}
gvisor.dev/gvisor/pkg/tcpip/transport/tcp.(*Endpoint).beforeSave(0xc00027f808)
\tgvisor.dev/gvisor/pkg/tcpip/transport/tcp/endpoint_state.go:43 +0x387
created by gvisor.dev/gvisor/pkg/urpc.(*Server).StartHandling in goroutine 14
\tgvisor.dev/gvisor/pkg/urpc/urpc.go:451 +0x6b"""
CONNECTED = ('checkpoint failed: checkpointing container "m_x": encoding error: save '
             "rejected due to unsupported networking state: endpoint cannot be saved in "
             "connected state: local 10.0.2.15:37412, remote 10.0.2.2:35987:"
             + _TRACE.format(frame="panic({0x1144c40?, 0xc00053aaf0?})"))
OPENING = ('checkpoint failed: checkpointing container "m_x": encoding error: runtime '
           "error: invalid memory address or nil pointer dereference:"
           + _TRACE.format(frame="gvisor.dev/gvisor/pkg/tcpip/transport/tcp.(*Endpoint)"
                                 ".resetConnectionLocked(0xc00018b808, {0x158a1b0?})"))


def test_a_connection_being_opened_is_named() -> None:
    why = checkpoint_refusal(OPENING)
    assert why is not None and "being opened" in why[0] and "retry" in why[1]


def test_a_connected_endpoint_of_a_sandbox_without_the_flag_is_named() -> None:
    why = checkpoint_refusal(CONNECTED)
    assert why is not None and "remote 10.0.2.2:35987" in why[0] and "goroutine" not in why[0]
    assert "--net-disconnect-ok" in why[1]


def test_other_failures_are_not_the_guests_tcp_state() -> None:
    assert checkpoint_refusal("checkpoint failed: no space left on device") is None
    assert checkpoint_refusal("") is None


def test_a_failure_message_is_runsc_s_words_not_its_stack() -> None:
    assert _error_head(CONNECTED).endswith("remote 10.0.2.2:35987:")
    assert _error_head("plain words") == "plain words"


def test_only_a_sandbox_with_a_network_resets_its_connections_at_a_checkpoint() -> None:
    runsc = Runsc("runsc", Path("/state"), Path("/logs"))
    assert "--net-disconnect-ok" in runsc.argv("restore", network="sandbox")
    assert "--net-disconnect-ok" not in runsc.argv("checkpoint")
