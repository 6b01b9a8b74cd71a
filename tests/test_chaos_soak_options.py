"""The chaos soak's deployment options build the command lines they name (no bed is started: `PDCluster` only
builds argv, and `netns.Host` is a plain record): push puts NixlPushConnector on both pools and nothing on the
proxy (it learns the mode), the TP sizes go to their pools only, and the long cuts outlast the proxy's
ejection bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.proxy.config import ProxyConfig
from pdserve.testing.chaos import FAULTS, SoakConfig, ejection_bound_s
from pdserve.testing.netns import Host
from pdserve.testing.pd_cluster import PDCluster, hosts_needed


class _Bed:  # what PDCluster's constructor reads of a Testbed
    def __init__(self, n: int) -> None:
        self.hosts = [Host(i, f"unused-h{i}", f"10.200.0.{i + 2}", f"p{i}") for i in range(n)]


def _cluster(tmp_path: Path, **kw) -> PDCluster:
    return PDCluster(_Bed(hosts_needed(2, 2)), tmp_path / "model", tmp_path, **kw)  # type: ignore[arg-type]


def _kv(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def _tp(argv: list[str]) -> str | None:
    return argv[argv.index("--tensor-parallel-size") + 1] if "--tensor-parallel-size" in argv else None


def test_push_with_tp_decode(tmp_path: Path) -> None:
    c = _cluster(tmp_path, transfer_mode="push", decode_tp=2)
    assert [_kv(n.argv)["kv_connector"] for n in [*c.prefill, *c.decode]] == ["NixlPushConnector"] * 4
    assert [_kv(n.argv)["kv_role"] for n in [*c.prefill, *c.decode]] == ["kv_producer"] * 2 + ["kv_consumer"] * 2
    assert [_tp(n.argv) for n in [*c.prefill, *c.decode, c.collocated]] == [None, None, "2", "2", None]
    assert "--kv-transfer-config" not in c.collocated.argv
    assert not any("kv-transfer-mode" in a for a in c.proxy.argv)  # learnt from /pdserve/info


def test_prefill_tp_and_pull_default(tmp_path: Path) -> None:
    c = _cluster(tmp_path, prefill_tp=2)
    assert [_kv(n.argv)["kv_connector"] for n in [*c.prefill, *c.decode]] == ["NixlConnector"] * 4
    assert [_tp(n.argv) for n in [*c.prefill, *c.decode]] == ["2", "2", None, None]


@pytest.mark.parametrize("kw", [{"transfer_mode": "pushy"}, {"decode_tp": 0}])
def test_bad_options_refused(tmp_path: Path, kw: dict) -> None:
    with pytest.raises(ValueError):
        _cluster(tmp_path, **kw)


def test_long_cuts_outlast_the_ejection_bound() -> None:
    # proxy defaults: a 5 s probe interval, 2 s probe timeout, ejected on the 3rd failure (1 s fast rounds)
    assert ejection_bound_s() == 13.0
    assert ejection_bound_s(ProxyConfig(health_interval=1.0, eject_after=1)) == 3.0
    assert SoakConfig().long_hold_s > ejection_bound_s()
    assert {"long-cut-decode", "long-cut-prefill"} <= set(FAULTS)
