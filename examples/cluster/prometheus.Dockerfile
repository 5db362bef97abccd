# Prometheus for docker-compose.yml, from Debian's prometheus package, on the same base as
# Broky's image: `scripts/build-image --cluster` builds it with podman on its Debian base;
# `docker compose build` on Debian's image. The configuration is mounted at
# /etc/prometheus/prometheus.yml (docker-compose.yml mounts prometheus.yml there).
ARG BASE=docker.io/library/debian:bookworm-slim
FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends prometheus \
    && apt-get clean && rm -rf /var/lib/apt/lists/*
USER prometheus
WORKDIR /var/lib/prometheus
EXPOSE 9090
ENTRYPOINT ["prometheus", "--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/var/lib/prometheus/metrics2"]
