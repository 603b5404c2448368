"""Which cores each side-by-side server is pinned to (``benchmarks.gpu_cores``): hand-made sysfs trees."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu_cores import EVEN, NUMA, lane_cores, lanes_local, local_cpus, parse_cpulist, span, sysfs_bus_id

CORES = list(range(32))


def test_cpulists_and_bus_ids_parse() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == set()
    assert sysfs_bus_id("00000000:18:00.0") == "0000:18:00.0"
    assert sysfs_bus_id("00000000:AB:00.0") == "0000:ab:00.0"
    assert span([16, 17, 31]) == "16-31 (3)" and span([]) == "any"


def test_gpus_on_two_nodes_get_their_own_nodes_cores() -> None:
    """GPU 0 on the node of cores 16-31, GPU 1 on 0-15: the naive halves would put each server across the host."""
    lanes, how = lane_cores(2, CORES, [set(range(16, 32)), set(range(16))])
    assert how == NUMA
    assert lanes == [list(range(16, 32)), list(range(16))]


def test_gpus_sharing_a_node_split_it() -> None:
    lanes, how = lane_cores(2, CORES, [set(range(16)), set(range(16))])
    assert (lanes, how) == ([list(range(8)), list(range(8, 16))], NUMA)


def test_unknown_or_odd_topologies_fall_back_to_even_halves() -> None:
    even = [list(range(16)), list(range(16, 32))]
    assert lane_cores(2, CORES, [None, set(range(16))]) == (even, EVEN)  # a GPU the host says nothing of
    assert lane_cores(2, CORES, [set(range(20)), set(range(12, 32))]) == (even, EVEN)  # overlapping nodes
    # a node of which this process may use only 2 cores: under half an even share
    assert lane_cores(2, CORES, [{0, 1, 40, 41}, set(range(16, 32))]) == (even, EVEN)
    assert lane_cores(1, CORES, []) == ([CORES], EVEN)


def test_local_cpus_reads_sysfs(tmp_path: Path) -> None:
    for bus, text in (("0000:18:00.0", "0-15\n"), ("0000:9a:00.0", "")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "local_cpulist").write_text(text)
    got = local_cpus(["0000:18:00.0", "0000:9a:00.0", "0000:ff:00.0"], root=tmp_path)
    assert got == [set(range(16)), None, None]


def test_a_lane_of_several_gpus_takes_their_nodes_together() -> None:
    """TP = 2 lanes on four GPUs, two per node: each lane's engine sits on one node; a lane across both nodes spans
    both, and a GPU the host says nothing of leaves its lane unknown."""
    node0, node1 = set(range(16)), set(range(16, 32))
    assert lanes_local([node0, node0, node1, node1], 2, 2) == [node0, node1]
    assert lanes_local([node0, node1, node0, node1], 2, 2) == [node0 | node1, node0 | node1]
    assert lanes_local([node0, None, node1, node1], 2, 2) == [None, node1]
    assert lanes_local([node0], 2, 1) == [node0, None]  # fewer GPUs than lanes
    lanes, how = lane_cores(2, CORES, lanes_local([node0, node0, node1, node1], 2, 2))
    assert (lanes, how) == ([list(range(16)), list(range(16, 32))], NUMA)
