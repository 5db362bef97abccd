# Broky server image: `docker build -t broky .` then
# `docker run --rm -p 127.0.0.1:4777:4777 -p 127.0.0.1:9477:9477 broky` (any `broky serve`
# option may follow).
# Where no registry of base images is reachable, `scripts/build-image` builds it with
# podman on a minimal Debian base of its own (mmdebstrap) passed as BASE.
#
# The build stage compiles the wheel (the fan-out's fast path, broky/server/shard/_feedscan.c,
# the SDK's publish encoding, broky/client/_pubpack.c, and the Spark source's column decoder,
# broky/spark/_readcols.c) and installs it with its
# dependencies into a virtual environment, /opt/broky; the image that runs it gets that
# environment alone: no compiler, no pip.
ARG BASE=docker.io/library/python:3.11-slim

FROM ${BASE} AS build
# Debian's own python3 (a base made by scripts/build-image) keeps Python.h and venv's pip
# in packages of their own; the python image has both.
RUN set -eu; pkgs="gcc libc6-dev"; \
    if [ "$(command -v python3)" = /usr/bin/python3 ]; then pkgs="$pkgs python3-dev python3-venv"; fi; \
    apt-get update && apt-get install -y --no-install-recommends $pkgs && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The dependencies first, in a layer of their own: a change to Broky's code alone rebuilds
# from the next step, in seconds. A CA bundle given as the build secret `ca`
# (scripts/build-image passes the host's, for a network that inspects TLS) is mounted for
# this step only: it is in no layer.
COPY pyproject.toml ./
RUN --mount=type=secret,id=ca \
    set -eu; if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    python3 -m venv /opt/broky \
    && python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); print(*p['build-system']['requires'], *p['project']['dependencies'], *p['project']['optional-dependencies']['cluster'], sep='\\n')" > /tmp/requirements.txt \
    && /opt/broky/bin/pip install --no-cache-dir --disable-pip-version-check -r /tmp/requirements.txt
COPY setup.py README.md ./
COPY broky ./broky
# The wheel must hold both compiled modules (a missing compiler or Python.h would leave the
# pure-Python fallbacks in, silently). Then pip and setuptools leave the environment.
RUN /opt/broky/bin/pip wheel --no-deps --no-build-isolation --disable-pip-version-check -w /wheels . \
    && python3 -c "import glob, sys, zipfile; n = [n for w in glob.glob('/wheels/*.whl') for n in zipfile.ZipFile(w).namelist()]; sys.exit(not all(any(x.startswith(m) and x.endswith('.so') for x in n) for m in ('broky/server/shard/_feedscan', 'broky/client/_pubpack')))" \
    && /opt/broky/bin/pip install --no-deps --no-cache-dir --disable-pip-version-check /wheels/broky-*.whl \
    && /opt/broky/bin/pip uninstall -q -y pip setuptools

FROM ${BASE}

# The server binds 0.0.0.0 inside the container, so that published ports reach it; who can
# reach those is decided by `-p` on the host, which the server cannot see. So the image
# serves without a credential (with a WARNING in its log and broky_unauthenticated_public 1):
# publish on 127.0.0.1, or set BROKY_AUTH_TOKEN / --users; -e BROKY_ALLOW_UNAUTHENTICATED=no
# makes it refuse to start without one, as `broky serve` does beyond loopback.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    BROKY_ALLOW_UNAUTHENTICATED=1 \
    PATH=/opt/broky/bin:$PATH

# With the cluster extra (the etcd client): `broky serve --cluster etcd://...` works in the image.
COPY --from=build /opt/broky /opt/broky

RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin broky
USER broky
WORKDIR /

# Clients, then HTTP (/healthz and metrics).
EXPOSE 4777 9477

HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, ssl, sys, urllib.request; port = os.environ.get('BROKY_METRICS_PORT', '9477'); port = port if port.isdigit() else '9477'; tls = bool(os.environ.get('BROKY_TLS_CERT')); url = f\"{'https' if tls else 'http'}://127.0.0.1:{port}/healthz\"; sys.exit(0 if urllib.request.urlopen(url, timeout=2, context=ssl._create_unverified_context() if tls else None).status == 200 else 1)"]

ENTRYPOINT ["broky", "serve", "--host", "0.0.0.0"]
