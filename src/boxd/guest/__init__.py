"""The in-guest agent (stdlib only) and the wire protocol it shares with the host."""
