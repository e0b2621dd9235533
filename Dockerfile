# syntax=docker/dockerfile:1
#
# One image for the whole sas suite: submission, scheduler, agent, supervisor,
# dashboard, sasctl, sas-chaos and remote-sim, all in /usr/local/bin. Pick the program with the
# container command, e.g. `docker run IMAGE scheduler` or compose's `command:`.
#
# Needs BuildKit (the default builder of current Docker; `docker compose` uses
# it) for the cache mounts, which keep the cargo registry and the target
# directory between builds, so a source change recompiles only the sas crates.

ARG RUST_IMAGE=rust:1.95-trixie
ARG RUNTIME_IMAGE=debian:trixie-slim

# ---------------------------------------------------------------------------
FROM ${RUST_IMAGE} AS builder

WORKDIR /build

# Only what cargo needs: the workspace manifests and lock file, every member's
# sources (the test and bench crates too: the workspace names them, though
# only the binaries are built), migrations/ (embedded at compile time by
# sqlx::migrate!) and third_party/ (the patched crates of Cargo.toml's
# [patch.crates-io]).
COPY Cargo.toml Cargo.lock ./
COPY protocol ./protocol
COPY core ./core
COPY tls ./tls
COPY store ./store
COPY broker ./broker
COPY runtime ./runtime
COPY engine ./engine
COPY client ./client
COPY services ./services
COPY testkit ./testkit
COPY tests ./tests
COPY bench ./bench
COPY migrations ./migrations
COPY third_party ./third_party

# The target directory lives in a cache mount, so the binaries are copied out
# to /out within the same step.
RUN --mount=type=cache,id=sas-cargo-registry,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,id=sas-cargo-git,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,id=sas-target,target=/build/target,sharing=locked \
    set -eux; \
    cargo build --release --locked -p submission -p scheduler -p agent -p supervisor \
        -p dashboard -p sasctl -p sas-chaos -p remote-sim; \
    mkdir -p /out; \
    for bin in submission scheduler agent supervisor dashboard sasctl sas-chaos remote-sim; do \
        install -m 0755 "target/release/${bin}" "/out/${bin}"; \
    done

# ---------------------------------------------------------------------------
FROM ${RUNTIME_IMAGE} AS runtime

# ca-certificates for https:// agents, curl for healthchecks, tini to forward
# SIGTERM and reap children when a program (or the demo script) is PID 1.
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends ca-certificates curl tini; \
    rm -rf /var/lib/apt/lists/*; \
    groupadd --system --gid 10001 sas; \
    useradd --system --uid 10001 --gid sas --home-dir /nonexistent --no-create-home \
        --shell /usr/sbin/nologin sas

COPY --from=builder /out/ /usr/local/bin/
COPY scripts/demo-app.sh /usr/local/bin/demo-app.sh
RUN chmod 0755 /usr/local/bin/demo-app.sh && mkdir -p /etc/sas

# No configuration is baked in: mount it at /etc/sas (compose mounts
# ./config, Kubernetes a ConfigMap) and set SAS_CONFIG (e.g.
# /etc/sas/demo.toml) or pass --config; SAS__SECTION__KEY variables override
# either.
ENV REMOTE_SIM_HOST=0.0.0.0 \
    SAS__HTTP__HOST=0.0.0.0

USER 10001:10001
WORKDIR /tmp

# submission 9101, scheduler 9102, agent 9103, supervisor 9104, dashboard 9105,
# remote-sim 8081.
EXPOSE 9101 9102 9103 9104 9105 8081

ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["sasctl", "--help"]
