# etcd for docker-compose.yml, from Debian's etcd-server package (3.4), on the same base as
# Broky's image: `scripts/build-image --cluster` builds it with podman on its Debian base;
# `docker compose build` on Debian's image.
ARG BASE=docker.io/library/debian:bookworm-slim
FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends etcd-server \
    && apt-get clean && rm -rf /var/lib/apt/lists/*
# The package's user and its data directory (a volume in docker-compose.yml).
USER etcd
WORKDIR /var/lib/etcd
EXPOSE 2379 2380
# Healthy once /health says so (bash's /dev/tcp: no HTTP client needed in the image).
HEALTHCHECK --interval=2s --timeout=3s --retries=15 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/2379 && printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3 && grep -q '\"health\":\"true\"' <&3"]
ENTRYPOINT ["etcd"]
