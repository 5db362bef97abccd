# Broky server image: `docker build -t broky .` then
# `docker run --rm -p 4777:4777 -p 9477:9477 broky` (any `broky serve` option may follow).
# The wheel is built with a C compiler (the fan-out's compiled fast path,
# broky/server/_feedscan.c, and the SDK's publish encoding, broky/client/_pubpack.c);
# the image that runs it has none.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY broky ./broky
RUN pip wheel --no-cache-dir --no-deps -w /wheels . \
    && python -c "import glob, sys, zipfile; n = [n for w in glob.glob('/wheels/*.whl') for n in zipfile.ZipFile(w).namelist()]; sys.exit(not all(any(x.startswith(m) and x.endswith('.so') for x in n) for m in ('broky/server/_feedscan', 'broky/client/_pubpack')))"

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# With the cluster extra (the etcd client): `broky serve --cluster etcd://...` works in the image.
COPY --from=build /wheels /wheels
RUN pip install "$(ls /wheels/broky-*.whl)[cluster]" && rm -rf /wheels

RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin broky
USER broky
WORKDIR /

# Clients, then HTTP (/healthz and metrics).
EXPOSE 4777 9477

HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, ssl, sys, urllib.request; port = os.environ.get('BROKY_METRICS_PORT', '9477'); port = port if port.isdigit() else '9477'; tls = bool(os.environ.get('BROKY_TLS_CERT')); url = f\"{'https' if tls else 'http'}://127.0.0.1:{port}/healthz\"; sys.exit(0 if urllib.request.urlopen(url, timeout=2, context=ssl._create_unverified_context() if tls else None).status == 200 else 1)"]

ENTRYPOINT ["broky", "serve", "--host", "0.0.0.0"]
