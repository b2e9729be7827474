"""What a gateway's and the backend's rabbitmq.conf hold (gateways/node.py, backend/node.py)."""

from backend.node import BackendNodeConfig
from gateways.node import GatewayNodeConfig
from infra.local.driver import LocalFederation
from infra.local.settings import load_settings

PORTS = {"amqp": 5672, "management": 15672, "prometheus": 15692, "mqtt": 1883}


#: a gateway's settings as the local driver passes them
GATEWAY = dict(
    region="local-eu",
    host="127.0.0.1",
    mqtt_host="127.0.1.1",
    ports=PORTS,
    admin_user="fedgate-admin",
    admin_password="pw",
    memory_mb=512,
    mqtt_tcp_buffer=32768,
    max_fds=65536,
)
BACKEND = dict(host="127.0.0.1", ports=PORTS, admin_user="fedgate-admin", admin_password="pw", memory_mb=512)


def test_a_gateway_conf_has_its_mqtt_listener_buffers_and_cluster_name():
    gw = GatewayNodeConfig(**GATEWAY)
    conf = gw.rabbitmq_conf()
    assert "mqtt.listeners.tcp.1 = 127.0.1.1:1883" in conf, "devices reach it on its own address"
    assert "listeners.tcp.1 = 127.0.0.1:5672" in conf, "the federation links on the federation's host"
    assert "mqtt.tcp_listen_options.sndbuf = 32768" in conf
    assert f"cluster_name = {gw.cluster_name}" in conf
    assert "vm_memory_high_watermark.absolute = 512MB" in conf
    assert gw.enabled_plugins.exists()


def test_40_nodes_deny_the_deprecated_statistics_collection_and_310_knows_no_such_line():
    line = "deprecated_features.permit.management_metrics_collection = false"
    assert line in GatewayNodeConfig(**GATEWAY).rabbitmq_conf().splitlines()
    old = GatewayNodeConfig(**GATEWAY, broker_release="3.10").rabbitmq_conf()
    assert "deprecated_features" not in old and "mqtt.listeners.tcp.1 = 127.0.1.1:1883" in old
    assert line in BackendNodeConfig(**BACKEND).rabbitmq_conf().splitlines()
    assert "deprecated_features" not in BackendNodeConfig(**BACKEND, broker_release="3.10").rabbitmq_conf()


def test_the_backend_conf_has_no_device_listener():
    be = BackendNodeConfig(**BACKEND)
    conf = be.rabbitmq_conf()
    assert "cluster_name = fedgate-backend" in conf
    assert "mqtt." not in conf
    assert be.max_fds == 8192 and be.enabled_plugins.exists()


def test_a_gateway_gets_an_erlang_port_for_every_descriptor_it_may_open(tmp_path):
    """A device's socket is an Erlang port, and RabbitMQ's scripts cap ports at 65,536 unless
    ERL_MAX_PORTS says otherwise: a gateway allowed 131,072 descriptors would refuse devices
    from the 65,537th on."""
    for max_fds, ports in ((131_072, "131072"), (20_000, "65536")):
        state = tmp_path / str(max_fds)
        settings = load_settings(
            env={}, state_dir=state, port_base=27700, regions="local-eu", gateway_max_fds=max_fds
        )
        _, env, fds = LocalFederation(settings).gateways()[0].command()
        assert (fds, env["ERL_MAX_PORTS"]) == (max_fds, ports)
