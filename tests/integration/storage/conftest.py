"""Storage backends for the shared suite: a local directory (as a path and as local://), fsspec's
memory://, and a real S3-compatible server (moto in server mode) started on 127.0.0.1 for the session."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass
class Backend:
    name: str
    dump_dir: str
    storage_options: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="session")
def s3_server():
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(params=["local", "local-url", "memory", "s3"])
def backend(request, tmp_path) -> Backend:
    if request.param == "local":
        return Backend("local", str(tmp_path / "dump"))
    if request.param == "local-url":  # fsspec's spelling of local files; no auto_mkdir needed
        return Backend("local-url", f"local://{tmp_path}/dump")
    if request.param == "memory":
        return Backend("memory", f"memory://stepskip-{uuid.uuid4().hex[:8]}/dump")
    endpoint = request.getfixturevalue("s3_server")
    import s3fs

    options = {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True}
    bucket = f"stepskip-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    return Backend("s3", f"s3://{bucket}/dump", options)


@dataclass
class CountingS3:
    """A moto S3 server of its own that records every HTTP request it serves (method and query): what a
    call costs on object storage, counted where the requests arrive."""

    endpoint: str
    requests: list[str]

    @property
    def options(self) -> dict[str, Any]:
        return {"client_kwargs": {"endpoint_url": self.endpoint}, "skip_instance_cache": True}

    def bucket(self) -> str:
        """A fresh bucket: ``s3://{bucket}/dump`` is a new dump dir."""
        import s3fs

        name = f"stepskip-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(**self.options).mkdir(name)
        return name


@pytest.fixture(scope="session")
def counting_s3(s3_server) -> Any:
    """A second moto server (moto's backends are per process: it sees the same buckets) whose WSGI app
    counts requests; started after ``s3_server`` so the credentials are set."""
    import logging
    import threading

    pytest.importorskip("s3fs")
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    requests: list[str] = []
    lock = threading.Lock()

    class Counted(ThreadedMotoServer):
        def _server_entry(self) -> None:
            app = DomainDispatcherApplication(create_backend_app)

            def counted(environ: dict[str, Any], start_response: Any) -> Any:
                with lock:
                    requests.append(f"{environ['REQUEST_METHOD']} {environ.get('PATH_INFO', '')}?"
                                    f"{environ.get('QUERY_STRING', '')}")
                return app(environ, start_response)

            self._server = make_server(self._ip_address, self._port, counted, True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    server = Counted(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield CountingS3(f"http://{host}:{port}", requests)
    finally:
        server.stop()
