"""Engines: run machines behind one interface (`boxd.engine.base`); QEMU is the reference."""
