# The services, mock-vllm, the load generator and replay in one image
# (docker-compose.yml).
FROM rust:1.95-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev python3 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The tokenizer and chat template the project ships (scripts/make-tokenizer).
RUN python3 scripts/make-tokenizer /tokenizer
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kv-indexer -p router -p worker-agent -p loadgen -p mock-vllm -p replay \
 && mkdir -p /out \
 && cp target/release/kv-indexer target/release/router target/release/worker-agent target/release/loadgen \
       target/release/mock-vllm target/release/replay /out/

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/ /usr/local/bin/
COPY --from=build /tokenizer/ /usr/local/share/switchyard/tokenizer/
