"""Fixtures shared by the unit tests: the fake-engine `world` (tests/_support/fake_world.py);
a module that defines its own ``world`` (other settings) overrides it."""

from tests._support.fake_world import world

__all__ = ["world"]
