"""The test harness: fixtures' machinery, fakes and helpers shared by test files.

Test files import helpers from here, never from a sibling ``test_*.py``:
``daemon`` (a real `boxd serve` and its clean-up), ``vm_guard`` (no machine outside a
``vm`` test), ``guest`` (counters in a guest), ``procs`` (QEMU processes of machines),
``rl_envs`` (Gymnasium envs pickled into machines), ``sdk_daemon`` (an in-process
daemon over the fake services), ``agent_guest`` (the real agent over a fake QEMU port),
``cgroups`` (cgroup v1 helpers).
"""
