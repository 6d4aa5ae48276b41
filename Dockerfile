# queued in a container: `docker build -t queued .` then, with a users file made with
# `queued passwd` (see docs/security.md):
#   docker run -d --name queued -v queued-data:/var/lib/queued \
#       -v ./users.toml:/etc/queued/users.toml:ro -e QUEUED_USERS_FILE=/etc/queued/users.toml \
#       -p 22133:22133 -p 2222:2222 -p 2229:2229 -p 2223:2223 queued
# The server listens on 0.0.0.0 here, so without a users file it refuses to start; for a
# quick local try without users, accept that risk explicitly: -e QUEUED_ALLOW_ANONYMOUS=1.
#
# BASE_IMAGE is any Debian-like image with python3 (>= 3.11) and its venv module; every
# stage uses it, so the venv's interpreter is the runtime's. `make test-docker` passes a
# local one built from Debian packages (tests/docker/setup.sh).
#
# QUEUED_BUILD=compiled (the default) serves the mypyc-compiled build of the hot modules
# (`make compiled`, docs/development.md "Compiled with mypyc"); QUEUED_BUILD=pure serves
# the same code as plain Python. The compile stage needs gcc and Python's headers (from
# Debian's apt) and mypy (from PyPI); none of them reaches the runtime image.
ARG BASE_IMAGE=python:3.12-slim
ARG QUEUED_BUILD=compiled

# -- build: the project and its dependencies in a venv at /opt/queued ------------------------
FROM ${BASE_IMAGE} AS build
LABEL org.opencontainers.image.title="queued-build"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
# The dependencies first, in a layer of their own that stays cached while only the code (or
# README) changes; then the project itself. `python3 -m venv`: python3 is /usr/local/bin/python3
# in python:*-slim and /usr/bin/python3 in Debian's own images.
COPY pyproject.toml ./
RUN python3 -m venv /opt/queued \
 && /opt/queued/bin/python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" >/tmp/requirements.txt \
 && /opt/queued/bin/python -m pip install -r /tmp/requirements.txt
# Only what `pip install .` needs (.dockerignore keeps everything else out of the context).
COPY README.md ./
COPY queued/ queued/
RUN /opt/queued/bin/python -m pip install --no-deps . \
 && /opt/queued/bin/python -m pip check \
 && /opt/queued/bin/queued --help >/dev/null

# -- the venv as it runs: pure, or with the compiled modules in place ---------------------------
FROM build AS venv-pure

FROM build AS venv-compiled
# The compiler: gcc, and Python's headers where the base image lacks them (Debian's python3
# has them in python3-dev; python:*-slim images ship their own).
RUN if ! python3 -c "import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then \
        headers=python3-dev; \
    fi \
 && apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends gcc libc6-dev ${headers:-} >/dev/null \
 && rm -rf /var/lib/apt/lists/*
# mypy (mypyc) and setuptools go into a copy of the venv that only this stage uses: the
# build type-checks against the server's own dependencies, and the venv that ships stays
# without them.
# (tools/mypyc_fixes.py mends mypyc's generated deallocators; the mypy range is
# pyproject.toml's, the one those fixes are checked against)
COPY tools/build_compiled.py tools/mypyc_fixes.py tools/
RUN cp -a /opt/queued /opt/compiler \
 && /opt/compiler/bin/python -m pip install "mypy>=1.10,<2.5" setuptools \
 && /opt/compiler/bin/python tools/build_compiled.py --out /tmp/compiled \
 && site=$(/opt/queued/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
 && cp /tmp/compiled/*.so "$site"/ \
 && (cd /tmp/compiled && find queued -name '*.so' -exec cp --parents {} "$site" \;) \
 && /opt/queued/bin/queued --version | tee /dev/stderr | grep -q "compiled with mypyc" \
 && rm -rf /opt/compiler /tmp/compiled

FROM venv-${QUEUED_BUILD} AS venv

# -- runtime ---------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="queued" \
      org.opencontainers.image.description="A durable message queue server: Kestrel's protocols and journal format" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed non-root uid/gid (10001), so a bind mount can be chown'ed to it from outside.
RUN groupadd --system --gid 10001 queued \
 && useradd --system --uid 10001 --gid queued --home-dir /var/lib/queued --no-create-home \
        --shell /usr/sbin/nologin queued \
 && mkdir -p /var/lib/queued \
 && chown queued:queued /var/lib/queued \
 && chmod 0750 /var/lib/queued
COPY --from=venv /opt/queued /opt/queued

# Settings go in QUEUED_<KEY> variables (`docker run -e QUEUED_FSYNC=never ...`) or as
# flags after the image name (`docker run queued --log-level DEBUG`); flags win over
# variables, variables over a config file (QUEUED_CONFIG). Host and data directory are
# variables here rather than flags in ENTRYPOINT so that both ways can override them.
ENV PATH=/opt/queued/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    QUEUED_HOST=0.0.0.0 \
    QUEUED_DATA_DIR=/var/lib/queued

USER 10001:10001
WORKDIR /var/lib/queued
# Journals and checkpoints. A new named volume starts as a copy of this (empty) directory
# owned by uid 10001; a bind-mounted directory must be writable by uid 10001.
VOLUME ["/var/lib/queued"]
# memcache, text, MessagePack-RPC, HTTP (/metrics, /livez, /readyz, /stats.json)
EXPOSE 22133 2222 2229 2223

# Healthy once /readyz answers 2xx on the HTTP port (QUEUED_HTTP_PORT, default 2223). Slim
# images have no curl, so python; no proxy for 127.0.0.1 whatever the environment says.
# The start period leaves time for recovery of large journals.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["/opt/queued/bin/python", "-c", "import os, urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:%s/readyz' % (os.environ.get('QUEUED_HTTP_PORT') or '2223'), timeout=2)"]

# Exec form: the server is PID 1 and gets docker stop's SIGTERM itself. On SIGTERM it closes
# its listeners, lets sessions finish their batch (shutdown_grace, 5 s by default), writes
# every checkpoint, fsyncs the journals and exits 0: inside docker stop's default 10 s.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/queued/bin/queued", "serve"]
