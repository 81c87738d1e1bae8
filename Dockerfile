# relayd as a container image. Two stages: the wheel is built in the first; the second
# installs it with its runtime dependencies pinned (deploy/constraints.txt: the versions the
# tests ran with) and nothing else.
#
# The image runs as the numeric user 10001:10001 and writes nothing outside /tmp, so it runs
# with a read-only root file system (mount a tmpfs on /tmp). Configuration by environment
# alone works (RELAYD_<SECTION>__<KEY>; /etc/relayd/config.toml is read if mounted, and
# --config or RELAYD_CONFIG name another file); secrets come from mounted files
# (RELAYD_DATABASE__DSN_FILE, RELAYD_SINK__TOKEN_FILE). See deploy/README.md.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY relayd ./relayd
COPY migrations ./migrations
RUN pip install --no-cache-dir build==1.2.2 && python -m build --wheel --outdir /dist

FROM ${PYTHON_IMAGE} AS runtime
# No bytecode written at run time (pip compiled it at install), output unbuffered.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN groupadd --system --gid 10001 relayd \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin relayd
COPY deploy/constraints.txt /tmp/constraints.txt
COPY --from=build /dist/ /tmp/dist/
# Every destination's client, the OpenTelemetry exporter and the console: one image relays
# to any sink, and serves `relayd console`.
RUN wheel="$(ls /tmp/dist/*.whl)" \
    && pip install --no-cache-dir --disable-pip-version-check -c /tmp/constraints.txt \
       "${wheel}[console,nats,otel]" \
    && rm -rf /tmp/dist /tmp/constraints.txt
# JSON logs; the endpoints listen beyond loopback so that a probe or a scrape can reach them
# (publish the port deliberately: they have no authentication).
ENV RELAYD_LOG__FORMAT=json \
    RELAYD_HTTP__LISTEN=0.0.0.0:9464
EXPOSE 9464
USER 10001:10001
# SIGTERM drains (relay.shutdown_grace_s, then up to 10 s to settle): give the container a
# stop timeout above shutdown_grace_s + 10 (docker run --stop-timeout 30).
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["relayd", "healthcheck", "--timeout", "3"]
ENTRYPOINT ["relayd"]
CMD ["run"]
