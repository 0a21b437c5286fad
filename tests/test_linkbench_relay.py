"""The measured link's C delay relay (testbed/linkbench/delay_relay.c): it builds, and it refuses bad
input; the link it serves needs root and namespaces (tests/test_link_measured.py, slow)."""
from __future__ import annotations

import subprocess

import pytest

from testbed.linkbench.netns import LinkSetupError, LinkSpec, relay_binary


def test_the_c_relay_builds_once_and_refuses_a_bad_delay():
    binary = relay_binary()
    assert relay_binary() == binary and binary.is_file()  # cached by the source's hash
    for args in ([], ["dly", "-1"], ["dly", "20"]):
        r = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=10)
        assert r.returncode == 2, (args, r.stdout, r.stderr)


def test_an_unknown_relay_is_refused_with_the_choices():
    with pytest.raises(LinkSetupError, match="valid choices: c, python"):
        LinkSpec(100e6, 0.03, "rust")
