# mha-serve image: mha_server + mha_client on Debian 12, the demo model in
# /models (mount your own model repository over it).
#   docker build -t mha-serve .
#   docker run --rm -p 50051:50051 -p 8000:8000 -p 9464:9464 -v "$PWD/models:/models:ro" mha-serve
# Build stage: the -dev packages and a compiler. Run stage: only the shared
# libraries the two binaries link, no compiler, no apt lists.

FROM debian:bookworm AS build
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      g++ cmake make libdnnl-dev ocl-icd-opencl-dev libabsl-dev libprotobuf-dev \
      protobuf-compiler libgrpc++-dev protobuf-compiler-grpc prometheus-cpp-dev \
      nlohmann-json3-dev libmicrohttpd-dev libgnutls28-dev zlib1g-dev pkg-config \
      libgoogle-perftools-dev libspdlog-dev ccache \
 && rm -rf /var/lib/apt/lists/*
# The sources' path in this stage (the deploy test gives its checkout's).
ARG MHA_SOURCE_DIR=/src
WORKDIR $MHA_SOURCE_DIR
COPY CMakeLists.txt ./
COPY proto proto
COPY engine engine
COPY server server
COPY client client
# ccache's files: build/ccache-seed when the context has it, which the deploy
# test makes from its host build (same compiler, path and flags, so most files
# come from it); else empty. The CMakeLists.txt in this line only keeps the
# COPY from failing when the seed is absent.
COPY CMakeLists.txt build/ccache-see[d] /ccache/
ENV CCACHE_DIR=/ccache
RUN ccache --zero-stats >/dev/null \
 && cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMHA_BUILD_TESTS=OFF \
      -DMHA_DEFAULT_MODEL_REPOSITORY=/models -DMHA_CCACHE=ON -DMHA_CCACHE_DIR=/ccache \
 && cmake --build build -j "$(nproc)" --target mha_server mha_client \
 && strip build/mha_server build/mha_client \
 && ccache --print-stats | awk '/_cache_hit\t/ { hits += $2 } /^cache_miss\t/ { misses += $2 } \
      END { print "ccache hits=" hits + 0 " misses=" misses + 0 }'

FROM debian:bookworm
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libdnnl2 libgomp1 ocl-icd-libopencl1 libabsl20220623 libprotobuf32 libgrpc++1.51 \
      libgrpc29 libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libmicrohttpd12 \
      libtcmalloc-minimal4 libspdlog1.10 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/apt /var/log/dpkg.log \
 && groupadd --system --gid 10001 mha \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin mha \
 && mkdir /sessions && chown 10001:10001 /sessions
ARG MHA_SOURCE_DIR=/src
COPY --from=build $MHA_SOURCE_DIR/build/mha_server $MHA_SOURCE_DIR/build/mha_client /usr/local/bin/
COPY models /models
USER 10001
EXPOSE 50051 9464 8000
# Health is open even with --auth_token_file; NOT_SERVING while loading or
# draining. (No --start-period: dockerfilelint rejects it; 3 retries x 10 s
# leave 30 s to load the models.)
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
  CMD ["mha_client", "health", "--target=127.0.0.1:50051", "--deadline_ms=2000"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["mha_server"]
CMD ["--model_repository=/models", "--port=50051", "--metrics_port=9464"]
