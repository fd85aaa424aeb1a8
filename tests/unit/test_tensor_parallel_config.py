"""`--tensor-parallel-size`, `--enable-expert-parallel` and the multi-node flags: combinations that
cannot work are refused with the flags named, before a model loads; `serve` has the size and the
expert placement but not the multi-node flags."""

from __future__ import annotations

import pytest

from zerobubble.config import ConfigError, WorkerConfig, service_settings


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(tensor_parallel_size=0), "--tensor-parallel-size must be >= 1"),
        (
            dict(tensor_parallel_size=3, nnodes=2, master_port=29500),
            "--tensor-parallel-size 3 must be a multiple of --nnodes 2",
        ),
        (
            dict(tensor_parallel_size=4, nnodes=2, node_rank=2, master_port=29500),
            r"--node-rank 2 must be in \[0, --nnodes 2\)",
        ),
        (dict(tensor_parallel_size=4, nnodes=2), "--nnodes > 1 needs --master-port"),
        (dict(tensor_parallel_size=2, simulate_device_ms=5.0), "--simulate-device-ms runs without a model"),
    ],
)
def test_impossible_groups_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WorkerConfig(**settings).validate()


def test_a_two_node_group_is_accepted() -> None:
    WorkerConfig(tensor_parallel_size=8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500).validate()


def test_serve_splits_its_local_worker_but_spans_no_machines() -> None:
    names = {f.name for _, f in service_settings("serve")}
    assert "tensor_parallel_size" in names
    assert not names & {"nnodes", "node_rank", "master_addr", "master_port"}


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_expert_parallel_is_a_flag_of_worker_and_serve_with_its_variable(command: str) -> None:
    from zerobubble.config import from_namespace
    from zerobubble.entrypoints.cli import build_parser

    flag = build_parser(env={}).parse_args([command, "--tensor-parallel-size", "2", "--enable-expert-parallel"])
    variable = build_parser(env={"ZEROBUBBLE_ENABLE_EXPERT_PARALLEL": "true"}).parse_args([command])
    default = build_parser(env={}).parse_args([command])
    settings = [from_namespace(WorkerConfig, args).enable_expert_parallel for args in (flag, variable, default)]
    assert settings == [True, True, False]


def test_expert_parallel_without_tensor_parallel_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from zerobubble.entrypoints.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["worker", "--enable-expert-parallel"])
    assert exited.value.code == 2
    assert "--enable-expert-parallel places experts over tensor-parallel ranks" in capsys.readouterr().err
