"""How fedgate's Kafka clients authenticate: one setting set, both client libraries.

The router and the CLI's read-backs use librdkafka (confluent-kafka); the Spark
job uses Kafka's Java client.  Both speak TLS and SASL/SCRAM -- what Amazon MSK
asks for (its SCRAM bootstrap, port 9096) and what the local federation's
Kafka offers beside its plaintext listener -- but name their settings
differently (`sasl.username` against a JAAS line, `ssl.ca.location` against a
PEM truststore).  KafkaSecurity holds the deployment's choice once and renders
each library's properties.

    kafka_security_protocol = "SASL_SSL"      # PLAINTEXT (default), SSL, SASL_SSL
    kafka_sasl_mechanism = "SCRAM-SHA-512"    # or SCRAM-SHA-256
    kafka_sasl_username = "fedgate-router"
    kafka_sasl_password = "..."
    kafka_ca_file = "/etc/fedgate/kafka-ca.pem"   # empty: the system's trust store
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_SSL")
MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256")
#: The JAAS login module of the Java client's SCRAM.
_SCRAM_MODULE = "org.apache.kafka.common.security.scram.ScramLoginModule"


class KafkaSecurityError(ValueError):
    pass


@dataclass(frozen=True)
class KafkaSecurity:
    protocol: str = "PLAINTEXT"
    sasl_mechanism: str = "SCRAM-SHA-512"
    username: str = ""
    password: str = ""
    #: PEM file of the CA that signed the brokers' certificates ("": the system's trust store)
    ca_file: str = ""

    @classmethod
    def of(cls, settings: Any) -> KafkaSecurity:
        """From a settings object's kafka_security_protocol, kafka_sasl_mechanism,
        kafka_sasl_username, kafka_sasl_password and kafka_ca_file (the router's, the job's)."""
        return cls(
            settings.kafka_security_protocol,
            settings.kafka_sasl_mechanism,
            settings.kafka_sasl_username,
            settings.kafka_sasl_password,
            settings.kafka_ca_file,
        )

    def validate(self, prefix: str = "kafka_") -> KafkaSecurity:
        """Raise KafkaSecurityError naming the setting (`prefix` + its name) that is wrong."""
        if self.protocol not in PROTOCOLS:
            raise KafkaSecurityError(
                f"{prefix}security_protocol: one of {', '.join(PROTOCOLS)}, got {self.protocol!r}"
            )
        if self.sasl:
            if self.sasl_mechanism not in MECHANISMS:
                raise KafkaSecurityError(
                    f"{prefix}sasl_mechanism: one of {', '.join(MECHANISMS)}, got {self.sasl_mechanism!r}"
                )
            for name in ("username", "password"):
                if not getattr(self, name):
                    raise KafkaSecurityError(f"{prefix}sasl_{name}: required with {self.protocol}")
                if '"' in getattr(self, name) or "\\" in getattr(self, name):
                    # the Java client reads them from a JAAS line
                    raise KafkaSecurityError(
                        f"{prefix}sasl_{name}: may not hold a double quote or a backslash"
                    )
        return self

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    def librdkafka(self) -> dict[str, str]:
        """The properties of a confluent-kafka client (producer, consumer, admin)."""
        out = {"security.protocol": self.protocol.lower()}
        if self.sasl:
            out |= {
                "sasl.mechanism": self.sasl_mechanism,
                "sasl.username": self.username,
                "sasl.password": self.password,
            }
        if self.tls and self.ca_file:
            out["ssl.ca.location"] = self.ca_file
        return out

    def java(self) -> dict[str, str]:
        """The properties of a Java Kafka client (the Spark source takes them prefixed `kafka.`)."""
        out = {"security.protocol": self.protocol}
        if self.sasl:
            out |= {
                "sasl.mechanism": self.sasl_mechanism,
                "sasl.jaas.config": (
                    f'{_SCRAM_MODULE} required username="{self.username}" password="{self.password}";'
                ),
            }
        if self.tls and self.ca_file:
            out |= {"ssl.truststore.type": "PEM", "ssl.truststore.location": self.ca_file}
        return out
