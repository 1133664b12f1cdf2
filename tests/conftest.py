"""Settings for every test process.

In-process gloo groups bind the loopback interface, as spawned worlds' ranks do
(torch_afdep.testing.use_loopback_gloo): every CPU world here runs on one host. A test that
hangs anyway is ended by pytest's faulthandler settings in pyproject.toml (every thread's
stack, then exit), so CI fails in minutes with the place it waited instead of running out its
time limit."""

from torch_afdep.testing import use_loopback_gloo

use_loopback_gloo()
