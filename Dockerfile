# Build: docker build -t oncegate .
# Run:   docker run --stop-timeout 40 -p 8080:8080 -v $PWD/config.toml:/etc/oncegate/config.toml -v oncegate-data:/var/lib/oncegate oncegate
FROM rust:1.95-slim-bookworm AS build
# tikv-jemalloc-sys builds jemalloc with make, which the slim images lack.
RUN apt-get update \
    && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY .cargo ./.cargo
COPY src ./src
COPY benches ./benches
RUN cargo build --release --locked --bin oncegate

FROM debian:bookworm-slim
RUN groupadd --system --gid 10001 oncegate \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/oncegate oncegate \
    && mkdir -p /etc/oncegate /var/lib/oncegate \
    && chown 10001:10001 /var/lib/oncegate
COPY --from=build /src/target/release/oncegate /usr/local/bin/oncegate
# Numeric, so that Kubernetes' runAsNonRoot can check it (deploy/kubernetes.yaml).
USER 10001:10001
WORKDIR /var/lib/oncegate
EXPOSE 8080 8081
VOLUME ["/var/lib/oncegate"]
ENTRYPOINT ["/usr/local/bin/oncegate"]
CMD ["run", "--config", "/etc/oncegate/config.toml"]
