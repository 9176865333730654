"""``--kv-transfer-config``: parsing, validation, the connector registry, and the way into
EngineConfig."""

import re

import pytest

from widellm.engine.arg_utils import EngineArgs
from widellm.kv_transfer import registry
from widellm.kv_transfer.config import (
    DEFAULT_LEASE_S, DEFAULT_TRANSFER_TIMEOUT_S, KVTransferConfig,
)
from widellm.kv_transfer.file_connector import FileConnectorWorker
from widellm.kv_transfer.pull_scheduler import PullConnectorScheduler
from widellm.kv_transfer.tcp import TCPConnectorWorker


def test_parse_json_string():
    cfg = KVTransferConfig.parse(
        '{"kv_connector": "TCPConnector", "kv_role": "kv_producer", '
        '"kv_load_failure_policy": "fail", '
        '"kv_connector_extra_config": {"lease_s": 5, "transfer_timeout_s": "2.5"}}')
    assert cfg == KVTransferConfig("TCPConnector", "kv_producer", "fail",
                                   {"lease_s": 5, "transfer_timeout_s": "2.5"})
    assert (cfg.is_producer, cfg.is_consumer) == (True, False)
    assert cfg.lease_s == 5.0 and cfg.transfer_timeout_s == 2.5
    assert cfg.extra("lease_s", None) == 5 and cfg.extra("missing", "d") == "d"


def test_parse_dict_defaults_and_passthrough():
    cfg = KVTransferConfig.parse({"kv_connector": "FileConnector"})
    assert cfg == KVTransferConfig("FileConnector", "kv_both", "recompute", {})
    assert (cfg.is_producer, cfg.is_consumer) == (True, True)
    assert cfg.lease_s == DEFAULT_LEASE_S == 30.0
    assert cfg.transfer_timeout_s == DEFAULT_TRANSFER_TIMEOUT_S == 30.0
    assert KVTransferConfig.parse(None) is None
    assert KVTransferConfig.parse(cfg) is cfg
    consumer = KVTransferConfig.parse({"kv_connector": "X", "kv_role": "kv_consumer"})
    assert (consumer.is_producer, consumer.is_consumer) == (False, True)


@pytest.mark.parametrize("value,message", [
    ("{not json", "--kv-transfer-config: not valid JSON"),
    ("[1, 2]", "--kv-transfer-config: must be a JSON object"),
    (7, "--kv-transfer-config: must be a JSON object"),
    ({"kv_connector": "TCPConnector", "kv_rol": "kv_both", "extra": 1},
     "--kv-transfer-config: unknown keys ['extra', 'kv_rol']; known: ['kv_connector', "
     "'kv_connector_extra_config', 'kv_load_failure_policy', 'kv_role']"),
    ({"kv_role": "kv_both"}, '--kv-transfer-config needs "kv_connector"'),
    ({"kv_connector": "TCPConnector", "kv_role": "prefill"},
     "kv_role must be one of ('kv_producer', 'kv_consumer', 'kv_both'), got 'prefill'"),
    ({"kv_connector": "TCPConnector", "kv_load_failure_policy": "retry"},
     "kv_load_failure_policy must be one of ('recompute', 'fail'), got 'retry'"),
    ({"kv_connector": "TCPConnector", "kv_connector_extra_config": [1]},
     "kv_connector_extra_config must be a JSON object"),
])
def test_parse_refuses(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        KVTransferConfig.parse(value)


def test_registry():
    assert sorted(registry.KV_CONNECTORS) == ["FileConnector", "TCPConnector"]
    assert registry.KV_CONNECTORS["TCPConnector"] == (PullConnectorScheduler,
                                                      TCPConnectorWorker, True)
    assert registry.KV_CONNECTORS["FileConnector"].worker is FileConnectorWorker
    # Only the TCP side channel serves a prompt that still runs.
    assert registry.supports_streaming(KVTransferConfig("TCPConnector"))
    assert not registry.supports_streaming(KVTransferConfig("FileConnector"))
    known = "known: ['FileConnector', 'TCPConnector']"
    bad = KVTransferConfig("NixlConnector")
    with pytest.raises(ValueError, match=re.escape(f"unknown kv_connector 'NixlConnector'; "
                                                   f"{known}")):
        registry.make_worker(bad, 16, 0)
    with pytest.raises(ValueError, match=re.escape(known)):
        registry.check_connector_name(bad)
    registry.check_connector_name(KVTransferConfig("TCPConnector"))


def test_make_worker_and_scheduler(tmp_path):
    cfg = KVTransferConfig("FileConnector", kv_connector_extra_config={"path": str(tmp_path)})
    worker = registry.make_worker(cfg, 16, 3)
    try:
        assert isinstance(worker, FileConnectorWorker)
        assert worker.engine_id.endswith("-dp3") and worker.block_size == 16
        sched = registry.make_scheduler(cfg, 16, worker)
        assert isinstance(sched, PullConnectorScheduler)
        assert sched.endpoint() == {"remote_engine_id": worker.engine_id,
                                    "kv_dir": str(tmp_path)}
    finally:
        worker.shutdown()


def test_engine_args_reach_engine_config(model_dir):
    path = model_dir("LlamaForCausalLM")
    config = EngineArgs(model=path, kv_transfer_config='{"kv_connector":"TCPConnector"}'
                        ).create_engine_config()
    assert config.kv_transfer_config == KVTransferConfig("TCPConnector")
    config = EngineArgs(model=path, kv_transfer_config={
        "kv_connector": "FileConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"path": "/tmp/x"}}).create_engine_config()
    assert config.kv_transfer_config == KVTransferConfig(
        "FileConnector", "kv_consumer", "recompute", {"path": "/tmp/x"})
    assert EngineArgs(model=path).create_engine_config().kv_transfer_config is None


@pytest.mark.parametrize("value,message", [
    ('{"kv_connector":"Nope"}', "unknown kv_connector 'Nope'"),
    ('{"kv_connector":"TCPConnector","kv_role":"both"}', "kv_role must be one of"),
])
def test_engine_args_refuse_a_bad_config(model_dir, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineArgs(model=model_dir("LlamaForCausalLM"),
                   kv_transfer_config=value).create_engine_config()
