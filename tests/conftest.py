"""Settings for every test process.

In-process gloo groups bind the loopback interface, as spawned worlds' ranks do
(torch_afdep.testing): every CPU world here runs on one host, and gloo otherwise resolves the
hostname first, a lookup that can stall where DNS does not answer. A test that hangs anyway is
ended by pytest's faulthandler settings in pyproject.toml (every thread's stack, then exit),
so CI fails in minutes with the place it waited instead of running out its time limit."""

import os

if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.isdir("/sys/class/net/lo"):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
