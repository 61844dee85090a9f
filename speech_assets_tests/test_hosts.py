"""Host names and endpoints from the settings: what may reach a command line (ours, torchrun's,
ssh's and, through ssh, a remote shell's) and a Flower connection file."""

from __future__ import annotations

import pytest

from speech_assets.hosts import check_endpoint, check_host, is_host

GOOD_HOSTS = [
    "10.0.0.5",
    "::1",
    "fe80::1%eth0",
    "fe80::1%2",
    "fe80::1%enp0s31f6",
    "fe80::1%br-lan.10",
    "node-1.example.com",
    "localhost",
    "localhost.",
    "n1",
]
BAD_HOSTS = [
    "fe80::1%$(id)",
    "fe80::1% x",
    "fe80::1%eth0 ",
    "fe80::1%`id`",
    "fe80::1%;id",
    "fe80::1%a|b",
    "fe80::1%a'b",
    "fe80::1%\nid",
    "fe80::1%",
    "fe80::1%interface-name-16",
    "10.0.0.5%eth0",
    "fe80::1%eth0%1",
    "::1 ",
    " ::1",
    "host name",
    "h$(id)",
    "-oProxyCommand=id",
    "a..b",
    "a:b",
    "",
    "x" * 254,
]


@pytest.mark.parametrize("host", GOOD_HOSTS)
def test_an_address_or_a_host_name_is_a_host(host: str) -> None:
    assert is_host(host) and check_host(host) == host


@pytest.mark.parametrize("host", BAD_HOSTS)
def test_spaces_and_shell_characters_are_no_host_anywhere_scope_ids_included(host: str) -> None:
    assert not is_host(host)
    with pytest.raises(ValueError, match="is not a host name or IP address"):
        check_host(host, "[training] node_hosts entry")


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("fl.example.org:9093", ("fl.example.org", 9093)),
        ("10.0.0.5:29500", ("10.0.0.5", 29500)),
        ("[::1]:9093", ("::1", 9093)),
        ("[fe80::1%eth0]:9092", ("fe80::1%eth0", 9092)),
    ],
)
def test_an_endpoint_is_a_host_and_a_port(endpoint: str, expected: tuple[str, int]) -> None:
    assert check_endpoint(endpoint) == expected


@pytest.mark.parametrize(
    "endpoint",
    [
        "[fe80::1%$(id)]:9092",
        "[fe80::1% x]:9092",
        "[fe80::1%eth0;id]:1",
        "::1:9093",
        "fe80::1%eth0:9092",
        "[1.2.3.4]:80",
        "[host]:80",
        "h$(id):1",
        "a b:1",
        "h:0",
        "h:65536",
        "h:port",
        "h: 80",
        "[::1]:",
        "h:1 ",
        "9093",
    ],
)
def test_an_endpoint_with_anything_more_is_refused(endpoint: str) -> None:
    with pytest.raises(ValueError, match="is not host:port"):
        check_endpoint(endpoint, "superlink")
