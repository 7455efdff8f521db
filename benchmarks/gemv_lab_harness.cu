// The C++ side of benchmarks/gemv_lab.py: fills the inputs on the GPU, computes a float32
// reference, measures the copy and read ceilings and times every kernel variant the Python side
// instantiated above this text (it replaces VARIANTS with their table, N and K are defined).
// One JSON object per line on stdout.

__device__ __forceinline__ uint32_t mix(uint64_t v) {
  v ^= v >> 33; v *= 0xff51afd7ed558ccdULL; v ^= v >> 33; v *= 0xc4ceb9fe1a85ec53ULL; v ^= v >> 33;
  return static_cast<uint32_t>(v);
}
__global__ void fill_codes(uint32_t* w, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    w[i] = mix(seed * 0x9E3779B97F4A7C15ULL + i);
}
__global__ void fill_scales(uint8_t* s, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t b = mix(seed * 0x9E3779B97F4A7C15ULL + i) & 0xFFu;
    if ((b & 0x7Fu) == 0x7Fu) b ^= 0x01u;  // no NaN scales; every other pattern, subnormals and signs included
    s[i] = static_cast<uint8_t>(b);
  }
}
__global__ void fill_x(__nv_bfloat16* x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = mix(seed * 0x9E3779B97F4A7C15ULL + i);
    float u = (static_cast<float>(h & 0xFFFFFu) / 1048576.0f) * 2.0f - 1.0f;
    x[i] = __float2bfloat16(ldexpf(u, static_cast<int>((h >> 20) % 5u) - 2));
  }
}
__device__ float e2m1(uint32_t c) {
  const float mag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  return (c & 8u) ? -mag[c & 7u] : mag[c & 7u];
}
__device__ float e4m3(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  const float v = e == 0 ? ldexpf(static_cast<float>(m), -9) : ldexpf(1.0f + m / 8.0f, static_cast<int>(e) - 7);
  return (b & 0x80u) ? -v : v;
}
__global__ void reference(const __nv_bfloat16* x, const uint32_t* w, const uint8_t* s, float gsv, float* y, int m, int n, int k) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= n) return;
  for (int r = 0; r < m; ++r) {
    float acc = 0.f;
    for (int kk = 0; kk < k; ++kk) {
      const uint32_t code = (w[(size_t)row * (k / 8) + kk / 8] >> (4 * (kk % 8))) & 15u;
      acc += __bfloat162float(x[(size_t)r * k + kk]) * e2m1(code) * e4m3(s[(size_t)row * (k / 16) + kk / 16]);
    }
    y[(size_t)r * n + row] = acc * gsv;
  }
}
__global__ void read_probe(const uint4* p, size_t n, uint32_t* sink) {
  uint32_t a = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint4 v = __ldcs(p + i);  // streaming, like the weights
    a ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (a == 0x9E3779B9u) sink[0] = a;  // keeps the loads; practically never taken
}

// The GEMV's weight stream without arithmetic: one warp per 16-row tile reads all of the tile's
// codes, each load instruction covering 32 / LPR rows x LPR * 16 contiguous bytes (LPR = 4 is the
// 64 bytes per row per step of a lane-per-16-bytes MMA mapping; 32 is a whole 512-byte segment).
template <int LPR>
__global__ void pattern_probe(const uint32_t* w, uint32_t* sink) {
  constexpr int ROW_BYTES = K / 2, SEG = LPR * 16, RPI = 32 / LPR, UNR = 8;
  const int lane = threadIdx.x & 31;
  const int tile = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (tile * 16 >= N) return;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(w) + (size_t)tile * 16 * ROW_BYTES;
  const int r0 = lane / LPR, c0 = (lane % LPR) * 16;
  uint32_t a = 0;
  constexpr int ITEMS = (ROW_BYTES / SEG) * (16 / RPI);  // (segment, row group) pairs
  for (int i0 = 0; i0 < ITEMS; i0 += UNR) {
    uint4 v[UNR];
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
      const int i = i0 + u;
      const int seg = i / (16 / RPI), rg = i % (16 / RPI);
      v[u] = i < ITEMS ? __ldcs(reinterpret_cast<const uint4*>(base + (size_t)(rg * RPI + r0) * ROW_BYTES + seg * SEG + c0))
                       : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNR; ++u) a ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (a == 0x9E3779B9u) sink[0] = a;
}

typedef void (*Kern)(const __nv_bfloat16*, const uint32_t*, const uint8_t*, const float*, __nv_bfloat16*);
struct V { const char* name; int m; Kern fn; int blocks; int threads; int smem; };

static float median(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

int main(int argc, char** argv) {
  const int NCOPY = 8, L = 48, REPS = 11;
  const size_t wn = (size_t)N * K / 8, sn = (size_t)N * K / 16;
  std::vector<uint32_t*> W(NCOPY); std::vector<uint8_t*> S(NCOPY);
  for (int c = 0; c < NCOPY; ++c) {
    // LAB_MANAGED: unified memory as MLX's allocator hands it out (cudaMallocManaged), populated
    // "prefetch": in bulk before the fill; "touch": by the fill kernel's first writes (as MLX's
    // own kernels populate their outputs); "bounce": touched, then moved to the host and back.
    const char* managed = getenv("LAB_MANAGED");
    cudaMemLocation gpu{}; gpu.type = cudaMemLocationTypeDevice; gpu.id = 0;
    if (managed) {
      CK(cudaMallocManaged(&W[c], wn * 4)); CK(cudaMallocManaged(&S[c], sn));
      if (!strcmp(managed, "prefetch")) {
        CK(cudaMemPrefetchAsync(W[c], wn * 4, gpu, 0, 0)); CK(cudaMemPrefetchAsync(S[c], sn, gpu, 0, 0));
      }
    } else {
      CK(cudaMalloc(&W[c], wn * 4)); CK(cudaMalloc(&S[c], sn));
    }
    fill_codes<<<1024, 256>>>(W[c], wn, 17 + c); fill_scales<<<1024, 256>>>(S[c], sn, 1017 + c);
    if (managed && !strcmp(managed, "bounce")) {
      cudaMemLocation host{}; host.type = cudaMemLocationTypeHost; host.id = 0;
      CK(cudaDeviceSynchronize());
      CK(cudaMemPrefetchAsync(W[c], wn * 4, host, 0, 0)); CK(cudaMemPrefetchAsync(S[c], sn, host, 0, 0));
      CK(cudaMemPrefetchAsync(W[c], wn * 4, gpu, 0, 0)); CK(cudaMemPrefetchAsync(S[c], sn, gpu, 0, 0));
    }
  }
  __nv_bfloat16 *x, *y; float *gsv, *yref; uint32_t* sink;
  CK(cudaMalloc(&x, 8 * K * 2)); CK(cudaMalloc(&y, 8 * (size_t)N * 2)); CK(cudaMalloc(&gsv, 4));
  CK(cudaMalloc(&yref, 8 * (size_t)N * 4)); CK(cudaMalloc(&sink, 4));
  fill_x<<<64, 256>>>(x, 8 * K, 5);
  const float gsv_h = 0.37f;
  CK(cudaMemcpy(gsv, &gsv_h, 4, cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
  printf("{\"kind\": \"device\", \"name\": \"%s\", \"sms\": %d, \"l2_bytes\": %d}\n", prop.name, sms, prop.l2CacheSize);

  {  // copy ceiling: 1 GiB device-to-device, bytes read + written
    const size_t bytes = (size_t)1 << 30; void *a, *b; CK(cudaMalloc(&a, bytes)); CK(cudaMalloc(&b, bytes));
    CK(cudaMemset(a, 1, bytes));
    std::vector<float> t;
    for (int r = 0; r < 7; ++r) {
      CK(cudaEventRecord(e0)); for (int i = 0; i < 4; ++i) CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
      CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms / 4);
    }
    printf("{\"kind\": \"copy\", \"gb_s\": %.1f}\n", 2.0 * bytes / (median(t) * 1e-3) / 1e9);
    CK(cudaFree(a)); CK(cudaFree(b));
  }
  {  // pure read of the weight copies (codes only, 16-byte streaming loads)
    std::vector<float> t;
    for (int r = 0; r < REPS; ++r) {
      CK(cudaEventRecord(e0));
      for (int i = 0; i < L; ++i) read_probe<<<sms * 8, 512>>>((const uint4*)W[i % NCOPY], wn / 4, sink);
      CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms / L);
    }
    CK(cudaGetLastError());
    printf("{\"kind\": \"read\", \"bytes\": %zu, \"us\": %.2f, \"gb_s\": %.1f}\n", wn * 4, median(t) * 1e3, wn * 4 / (median(t) * 1e-3) / 1e9);
  }
  {  // the weight stream's access pattern alone, at three segment widths per row
    const std::pair<int, void (*)(const uint32_t*, uint32_t*)> probes[] = {
        {4, pattern_probe<4>}, {16, pattern_probe<16>}, {32, pattern_probe<32>}};
    for (auto& p : probes) {
      std::vector<float> t;
      for (int r = 0; r < REPS; ++r) {
        CK(cudaEventRecord(e0));
        for (int i = 0; i < L; ++i) p.second<<<N / 16 / 4, 128>>>(W[i % NCOPY], sink);
        CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms / L);
      }
      CK(cudaGetLastError());
      printf("{\"kind\": \"pattern\", \"row_bytes_per_load\": %d, \"us\": %.2f, \"gb_s\": %.1f}\n", p.first * 16,
             median(t) * 1e3, wn * 4 / (median(t) * 1e-3) / 1e9);
    }
  }
  const std::vector<V> vs = {VARIANTS};
  std::vector<float> ref(8 * (size_t)N); std::vector<uint16_t> out(8 * (size_t)N);
  int last_m = -1;
  for (const V& v : vs) {
    if (v.smem > 0) CK(cudaFuncSetAttribute(v.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem));
  }
  for (const V& v : vs) {
    cudaFuncAttributes fa; CK(cudaFuncGetAttributes(&fa, v.fn));
    if (fa.numRegs * v.threads > 65536) {  // the launch would fail: too many registers for the block
      printf("{\"kind\": \"skipped\", \"name\": \"%s\", \"m\": %d, \"registers\": %d}\n", v.name, v.m, fa.numRegs);
      continue;
    }
    if (v.m != last_m) {
      reference<<<(N + 127) / 128, 128>>>(x, W[0], S[0], gsv_h, yref, v.m, N, K);
      CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(ref.data(), yref, (size_t)v.m * N * 4, cudaMemcpyDeviceToHost));
      last_m = v.m;
    }
    CK(cudaMemset(y, 0xFF, 8 * (size_t)N * 2));  // NaN poison
    v.fn<<<v.blocks, v.threads, v.smem>>>(x, W[0], S[0], gsv, y);
    CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(out.data(), y, (size_t)v.m * N * 2, cudaMemcpyDeviceToHost));
    double num = 0, den = 0; long nan = 0;
    for (size_t i = 0; i < (size_t)v.m * N; ++i) {
      uint32_t bits = (uint32_t)out[i] << 16; float f; memcpy(&f, &bits, 4);
      if (std::isnan(f)) { ++nan; continue; }
      num += (double)(f - ref[i]) * (f - ref[i]); den += (double)ref[i] * ref[i];
    }
    std::vector<float> t;
    for (int i = 0; i < 2 * NCOPY; ++i) v.fn<<<v.blocks, v.threads, v.smem>>>(x, W[i % NCOPY], S[i % NCOPY], gsv, y);
    // LAB_GRAPH: the L launches recorded once into a CUDA graph and replayed, as MLX's CUDA
    // backend launches its kernels (on a capturing stream; the events stay outside the graph)
    cudaGraphExec_t exec = nullptr;
    cudaStream_t st = nullptr;
    if (getenv("LAB_GRAPH")) {
      CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      cudaGraph_t graph;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < L; ++i) v.fn<<<v.blocks, v.threads, v.smem, st>>>(x, W[i % NCOPY], S[i % NCOPY], gsv, y);
      CK(cudaStreamEndCapture(st, &graph));
      CK(cudaGraphInstantiate(&exec, graph, 0));
      CK(cudaGraphDestroy(graph));
      CK(cudaGraphLaunch(exec, st)); CK(cudaStreamSynchronize(st));  // warm
    }
    for (int r = 0; r < REPS; ++r) {
      CK(cudaEventRecord(e0, st));
      if (exec) {
        CK(cudaGraphLaunch(exec, st));
      } else {
        for (int i = 0; i < L; ++i) v.fn<<<v.blocks, v.threads, v.smem>>>(x, W[i % NCOPY], S[i % NCOPY], gsv, y);
      }
      CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms / L);
    }
    if (exec) { CK(cudaGraphExecDestroy(exec)); CK(cudaStreamDestroy(st)); }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    const double bytes = (double)wn * 4 + sn + (double)v.m * K * 2 + (double)v.m * N * 2;
    printf("{\"kind\": \"variant\", \"name\": \"%s\", \"m\": %d, \"blocks\": %d, \"threads\": %d, \"us\": %.2f, "
           "\"us_min\": %.2f, \"us_max\": %.2f, \"gb_s\": %.1f, \"rel_err\": %.3e, \"unwritten\": %ld}\n",
           v.name, v.m, v.blocks, v.threads, t[t.size() / 2] * 1e3, t.front() * 1e3, t.back() * 1e3,
           bytes / (t[t.size() / 2] * 1e-3) / 1e9, std::sqrt(num / den), nan);
    fflush(stdout);
  }
  return 0;
}
