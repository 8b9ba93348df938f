/* A C program written against NVIDIA's nccl.h and CUDA's runtime, on device memory: built and run
 * on a GPU machine by tools/gpu-check.sh (and compiled, not run, by tests/c_program.rs), against
 * Chorus's libnccl.so.2 or NVIDIA's, whichever the loader finds.
 *
 *   device check W              forks W ranks (rank r on GPU r modulo their number); every rank
 *                               runs every collective on device memory, each call issued on a stream
 *                               between copies queued on that stream without waiting, checks every
 *                               value, prints how long a 64 MiB all-reduce took to return
 *                               against how long it took to finish, then revokes a copy of the
 *                               communicator with a call queued and shrinks it.
 *   device bench W BYTES ITERS  times an in-place float all-reduce of BYTES bytes with CUDA events
 *                               (after warm-up): rank 0 prints the median of five rounds. */
#include <cuda_runtime.h>
#include <string.h>
#include <sys/time.h>

#include "ranks.h"

#define CUDA(call)                                                                            \
  do {                                                                                        \
    cudaError_t e_ = (call);                                                                  \
    if (e_ != cudaSuccess) {                                                                  \
      fprintf(stderr, "rank %d: %s failed: %s\n", rank, #call, cudaGetErrorString(e_));       \
      exit(4);                                                                                \
    }                                                                                         \
  } while (0)

static double now_us(void) {
  struct timeval tv;
  gettimeofday(&tv, NULL);
  return tv.tv_sec * 1e6 + tv.tv_usec;
}

static ncclComm_t join(ncclUniqueId id, cudaStream_t *stream) {
  int devices = 0;
  CUDA(cudaGetDeviceCount(&devices));
  CUDA(cudaSetDevice(rank % devices));
  ncclComm_t comm;
  CHECK(ncclCommInitRank(&comm, nranks, id, rank));
  CUDA(cudaStreamCreate(stream));
  return comm;
}

/* `bytes` of device memory holding `from`'s bytes, copied on `s` without waiting. */
static void *upload(const void *from, size_t bytes, cudaStream_t s) {
  void *d;
  CUDA(cudaMalloc(&d, bytes));
  CUDA(cudaMemcpyAsync(d, from, bytes, cudaMemcpyHostToDevice, s));
  return d;
}

/* Copies `bytes` of device memory back on `s`, then waits for the stream. */
static void download(void *to, const void *d, size_t bytes, cudaStream_t s) {
  CUDA(cudaMemcpyAsync(to, d, bytes, cudaMemcpyDeviceToHost, s));
  CUDA(cudaStreamSynchronize(s));
}

static void check(ncclUniqueId id) {
  cudaStream_t s;
  ncclComm_t comm = join(id, &s);
  enum { N = (1 << 20) + 3 };
  float *h = malloc(N * sizeof(float)), *got = malloc(N * sizeof(float));
  for (int i = 0; i < N; i++) h[i] = (float)(rank + i % 7);
  /* Out of place, then in place: each call between copies on its stream, with no wait. */
  float *din = upload(h, N * sizeof(float), s), *dout;
  CUDA(cudaMalloc((void **)&dout, N * sizeof(float)));
  CHECK(ncclAllReduce(din, dout, N, ncclFloat, ncclSum, comm, s));
  download(got, dout, N * sizeof(float), s);
  for (int i = 0; i < N; i++) EXPECT(got[i] == (float)(nranks * (nranks - 1) / 2 + nranks * (i % 7)));
  CHECK(ncclAllReduce(din, din, N, ncclFloat, ncclMax, comm, s));
  download(got, din, N * sizeof(float), s);
  for (int i = 0; i < N; i++) EXPECT(got[i] == (float)(nranks - 1 + i % 7));

  int *ints = malloc(N * sizeof(int));
  for (int i = 0; i < N; i++) ints[i] = rank == nranks - 1 ? 3 * i : -1;
  int *dints = upload(ints, N * sizeof(int), s);
  CHECK(ncclBcast(dints, N, ncclInt, nranks - 1, comm, s));
  download(ints, dints, N * sizeof(int), s);
  for (int i = 0; i < N; i++) EXPECT(ints[i] == 3 * i);

  /* Reduce to rank 0; the others pass no output. */
  double mine = rank + 1, sum = 0;
  double *dmine = upload(&mine, sizeof mine, s), *dsum = NULL;
  if (rank == 0) CUDA(cudaMalloc((void **)&dsum, sizeof sum));
  CHECK(ncclReduce(dmine, dsum, 1, ncclDouble, ncclSum, 0, comm, s));
  if (rank == 0) {
    download(&sum, dsum, sizeof sum, s);
    EXPECT(sum == nranks * (nranks + 1) / 2.0);
  }

  /* All-gather in place, then reduce-scatter it back, then all-to-all. */
  long long *all = calloc(nranks, sizeof(long long)), part = 0;
  all[rank] = 100 + rank;
  long long *dall = upload(all, nranks * sizeof(long long), s), *dpart;
  CUDA(cudaMalloc((void **)&dpart, sizeof part));
  CHECK(ncclAllGather(dall + rank, dall, 1, ncclInt64, comm, s));
  download(all, dall, nranks * sizeof(long long), s);
  for (int r = 0; r < nranks; r++) EXPECT(all[r] == 100 + r);
  CHECK(ncclReduceScatter(dall, dpart, 1, ncclInt64, ncclMax, comm, s));
  download(&part, dpart, sizeof part, s);
  EXPECT(part == 100 + rank);
  for (int q = 0; q < nranks; q++) all[q] = 1000 * rank + q;
  long long *dsend = upload(all, nranks * sizeof(long long), s), *drecv;
  CUDA(cudaMalloc((void **)&drecv, nranks * sizeof(long long)));
  CHECK(ncclAlltoAll(dsend, drecv, 1, ncclInt64, comm, s));
  download(all, drecv, nranks * sizeof(long long), s);
  for (int q = 0; q < nranks; q++) EXPECT(all[q] == 1000 * q + rank);

  /* A ring of sends and receives in one group. */
  int to = (rank + 1) % nranks, from = (rank + nranks - 1) % nranks, sent = 1000 + rank, recvd = -1;
  int *dsent = upload(&sent, sizeof sent, s), *drecvd = upload(&recvd, sizeof recvd, s);
  CHECK(ncclGroupStart());
  CHECK(ncclSend(dsent, 1, ncclInt32, to, comm, s));
  CHECK(ncclRecv(drecvd, 1, ncclInt32, from, comm, s));
  CHECK(ncclGroupEnd());
  download(&recvd, drecvd, sizeof recvd, s);
  EXPECT(recvd == 1000 + from);

  /* The same ring with the receive on a second stream, whose copy after the group sees it. */
  cudaStream_t other;
  CUDA(cudaStreamCreate(&other));
  recvd = -1;
  CUDA(cudaMemcpyAsync(drecvd, &recvd, sizeof recvd, cudaMemcpyHostToDevice, other));
  sent = 2000 + rank;
  CUDA(cudaMemcpyAsync(dsent, &sent, sizeof sent, cudaMemcpyHostToDevice, s));
  CHECK(ncclGroupStart());
  CHECK(ncclSend(dsent, 1, ncclInt32, to, comm, s));
  CHECK(ncclRecv(drecvd, 1, ncclInt32, from, comm, other));
  CHECK(ncclGroupEnd());
  download(&recvd, drecvd, sizeof recvd, other);
  EXPECT(recvd == 2000 + from);
  CUDA(cudaStreamDestroy(other));

  /* A pre-multiplied sum: every input times 2 first. */
  float two = 2, one = 1, total = 0;
  ncclRedOp_t twice;
  CHECK(ncclRedOpCreatePreMulSum(&twice, &two, ncclFloat32, ncclScalarHostImmediate, comm));
  float *done = upload(&one, sizeof one, s);
  CHECK(ncclAllReduce(done, done, 1, ncclFloat32, twice, comm, s));
  download(&total, done, sizeof total, s);
  EXPECT(total == 2.0f * nranks);
  CHECK(ncclRedOpDestroy(twice, comm));

  /* The same with the scalar in device memory, read as the call runs (on a stream made by
   * cudaStreamCreate, which the legacy default stream synchronizes with). */
  float three = 3;
  float *dthree = upload(&three, sizeof three, s);
  CHECK(ncclRedOpCreatePreMulSum(&twice, dthree, ncclFloat32, ncclScalarDevice, comm));
  CUDA(cudaMemcpyAsync(done, &one, sizeof one, cudaMemcpyHostToDevice, s));
  CHECK(ncclAllReduce(done, done, 1, ncclFloat32, twice, comm, s));
  download(&total, done, sizeof total, s);
  EXPECT(total == 3.0f * nranks);
  CHECK(ncclRedOpDestroy(twice, comm));

  /* A 64 MiB all-reduce returns once it is issued. */
  size_t big = 16 << 20;
  float *dbig;
  CUDA(cudaMalloc((void **)&dbig, big * sizeof(float)));
  CUDA(cudaMemset(dbig, 0, big * sizeof(float)));
  CUDA(cudaDeviceSynchronize());
  double t0 = now_us();
  CHECK(ncclAllReduce(dbig, dbig, big, ncclFloat, ncclSum, comm, s));
  double returned = now_us() - t0;
  CUDA(cudaStreamSynchronize(s));
  double finished = now_us() - t0;
  ncclResult_t state;
  CHECK(ncclCommGetAsyncError(comm, &state));
  EXPECT(state == ncclSuccess);

  /* A copy of the communicator revoked with a call queued behind work on its stream: its
   * stream is released, its state turns ncclSuccess, and its shrink carries calls. The ranks
   * meet on the first communicator, on a stream of its own, once every call is issued. */
  ncclComm_t dup, shrunk;
  cudaStream_t side;
  CUDA(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  CHECK(ncclCommSplit(comm, 0, rank, &dup, NULL));
  for (int i = 0; i < 8; i++) CUDA(cudaMemsetAsync(dbig, 0, big * sizeof(float), s));
  CHECK(ncclAllReduce(dbig, dbig, big, ncclFloat, ncclSum, dup, s));
  int issued = 1;
  CHECK(ncclAllReduce(&issued, &issued, 1, ncclInt32, ncclSum, comm, side));
  CUDA(cudaStreamSynchronize(side));
  EXPECT(issued == nranks);
  CHECK(ncclCommRevoke(dup, NCCL_REVOKE_DEFAULT));
  double revoked = now_us();
  do CHECK(ncclCommGetAsyncError(dup, &state));
  while (state == ncclInProgress && now_us() - revoked < 30e6);
  EXPECT(state == ncclSuccess);
  CUDA(cudaStreamSynchronize(s));
  CHECK(ncclCommShrink(dup, NULL, 0, &shrunk, NULL, NCCL_SHRINK_DEFAULT));
  int members = 0;
  float unit = 1;
  CHECK(ncclCommCount(shrunk, &members));
  EXPECT(members == nranks);
  float *dunit = upload(&unit, sizeof unit, s);
  CHECK(ncclAllReduce(dunit, dunit, 1, ncclFloat, ncclSum, shrunk, s));
  download(&unit, dunit, sizeof unit, s);
  EXPECT(unit == (float)nranks);
  CHECK(ncclCommDestroy(shrunk));
  CHECK(ncclCommDestroy(dup));
  CUDA(cudaStreamDestroy(side));
  CHECK(ncclCommFinalize(comm));
  CHECK(ncclCommDestroy(comm));
  printf("rank %d of %d ok: a 64 MiB all-reduce returned in %.0f us and finished in %.0f us\n", rank,
         nranks, returned, finished);
}

static int by_value(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

static size_t bench_bytes;
static int bench_iters;

static void bench(ncclUniqueId id) {
  cudaStream_t s;
  ncclComm_t comm = join(id, &s);
  size_t count = bench_bytes / sizeof(float);
  float *d;
  CUDA(cudaMalloc((void **)&d, count * sizeof(float) + 4));
  CUDA(cudaMemset(d, 0, count * sizeof(float) + 4));
  cudaEvent_t start, stop;
  CUDA(cudaEventCreate(&start));
  CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 5; i++) CHECK(ncclAllReduce(d, d, count, ncclFloat, ncclSum, comm, s));
  CUDA(cudaStreamSynchronize(s));
  float rounds[5];
  for (int round = 0; round < 5; round++) {
    CUDA(cudaEventRecord(start, s));
    for (int i = 0; i < bench_iters; i++) CHECK(ncclAllReduce(d, d, count, ncclFloat, ncclSum, comm, s));
    CUDA(cudaEventRecord(stop, s));
    CUDA(cudaEventSynchronize(stop));
    float ms;
    CUDA(cudaEventElapsedTime(&ms, start, stop));
    rounds[round] = ms * 1000 / bench_iters;
  }
  qsort(rounds, 5, sizeof(float), by_value);
  double us = rounds[2], bus = bench_bytes * 2.0 * (nranks - 1) / nranks / us / 1e3;
  if (rank == 0) printf("bench W=%d bytes=%zu time_us=%.1f busbw_GBps=%.2f\n", nranks, bench_bytes, us, bus);
  CHECK(ncclCommDestroy(comm));
}

int main(int argc, char **argv) {
  void (*body)(ncclUniqueId) = NULL;
  if (argc == 3 && strcmp(argv[1], "check") == 0) body = check;
  if (argc == 5 && strcmp(argv[1], "bench") == 0) {
    body = bench;
    bench_bytes = strtoull(argv[3], NULL, 10);
    bench_iters = atoi(argv[4]);
  }
  nranks = body ? atoi(argv[2]) : 0;
  if (nranks < 1 || nranks > 64 || (body == bench && bench_iters < 1)) {
    fprintf(stderr, "usage: device check W | device bench W BYTES ITERS\n");
    return 1;
  }
  return run_ranks(body, -1);
}
