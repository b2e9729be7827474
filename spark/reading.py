"""The tables without Spark: pyiceberg reads the same Iceberg catalog the job writes,
and hands each table to pandas or DuckDB as Arrow.

    from spark.reading import open_catalog, duckdb_with_tables
    catalog = open_catalog(SparkSettings.load("state/nodes/spark/spark.toml"))
    catalog.load_table("telemetry.telemetry_raw").scan(row_filter="region = 'local-eu'").to_pandas()

    con = duckdb_with_tables(settings)   # every table as a DuckDB view of its current snapshot
    con.execute("SELECT region, count(*) FROM telemetry_raw GROUP BY region").fetchall()

A read sees one committed snapshot: never a half-landed batch.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from backend.errors import FedgateError
from spark.settings import SparkSettings
from spark.tables import TABLES


class CatalogError(FedgateError):
    pass


def sqlalchemy_uri(jdbc_uri: str, user: str = "", password: str = "") -> str:
    """The catalog's JDBC URL as pyiceberg's SqlCatalog (SQLAlchemy) spells it: SQLite (the
    local catalog) or PostgreSQL (a shared one, psycopg2), with the user and password."""
    if jdbc_uri.startswith("jdbc:sqlite:"):
        return "sqlite:///" + jdbc_uri.removeprefix("jdbc:sqlite:")
    if jdbc_uri.startswith("jdbc:postgresql://"):
        login = f"{quote(user, safe='')}:{quote(password, safe='')}@" if user else ""
        return f"postgresql+psycopg2://{login}" + jdbc_uri.removeprefix("jdbc:postgresql://")
    raise CatalogError(
        f"catalog_uri {jdbc_uri!r}: only a SQLite or PostgreSQL catalog is read without Spark here"
    )


def open_catalog(settings: SparkSettings) -> Any:
    """pyiceberg's view of the job's catalog (named as in Spark: settings.catalog)."""
    from pyiceberg.catalog.sql import SqlCatalog

    # an s3a:// warehouse: pyarrow's S3 file system, credentials from AWS's usual chain
    s3 = {"s3.endpoint": settings.s3_endpoint} if settings.s3_endpoint else {}
    if settings.s3_region:
        s3["s3.region"] = settings.s3_region
    return SqlCatalog(
        settings.catalog,
        uri=sqlalchemy_uri(settings.catalog_jdbc_uri, settings.catalog_user, settings.catalog_password),
        warehouse=settings.warehouse,
        **s3,
    )


def duckdb_with_tables(settings: SparkSettings, row_filter: str = "") -> Any:
    """A DuckDB connection with each table as a view named like it (read as Arrow, optionally
    filtered by a pyiceberg `row_filter` such as "date >= '2026-11-25'")."""
    import duckdb

    catalog = open_catalog(settings)
    con = duckdb.connect()
    for table in TABLES:
        scan = catalog.load_table(f"{settings.namespace}.{table.name}").scan(
            **({"row_filter": row_filter} if row_filter else {})
        )
        con.register(table.name, scan.to_arrow())
    return con
