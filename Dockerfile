# Build: docker build -t oncegate .
# Run:   docker run -p 8080:8080 -v $PWD/config.toml:/etc/oncegate/config.toml -v oncegate-data:/var/lib/oncegate oncegate
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
RUN useradd --system --uid 10001 --home-dir /var/lib/oncegate oncegate \
    && mkdir -p /etc/oncegate /var/lib/oncegate \
    && chown oncegate /var/lib/oncegate
COPY --from=build /src/target/release/oncegate /usr/local/bin/oncegate
USER oncegate
WORKDIR /var/lib/oncegate
EXPOSE 8080 8081
VOLUME ["/var/lib/oncegate"]
ENTRYPOINT ["/usr/local/bin/oncegate"]
CMD ["run", "--config", "/etc/oncegate/config.toml"]
