# relayd as a container: the wheel installed as a non-root user, configured by a mounted TOML
# file and/or RELAYD_* environment variables; secrets come from files (mounted secrets).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY relayd ./relayd
COPY migrations ./migrations
RUN pip install --no-cache-dir build==1.2.2 && python -m build --wheel --outdir /dist

FROM python:3.11-slim
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin relayd
COPY --from=build /dist/*.whl /tmp/
RUN pip install --no-cache-dir /tmp/*.whl && rm /tmp/*.whl
USER relayd
ENV RELAYD_CONFIG=/etc/relayd/config.toml \
    RELAYD_LOG__FORMAT=json
# In a container the metrics endpoint must listen beyond loopback; publish it deliberately.
ENV RELAYD_HTTP__LISTEN=0.0.0.0:9464
EXPOSE 9464
ENTRYPOINT ["relayd"]
CMD ["run"]
