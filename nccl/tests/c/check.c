/* A C program written against NVIDIA's nccl.h, run on Chorus's libnccl.so.2 by tests/c_program.rs.
 *
 *   check W    forks W ranks (before any NCCL call), rank 0 makes the unique id and hands it to the
 *              others through pipes; every rank runs the calls below on host memory, checks every
 *              value, and exits 0 only if all were right.
 *   check kill W   the same W ranks make one all-reduce; then the last rank kills itself, and the
 *              survivors' next call fails, their async error names it, they revoke it and split
 *              it among themselves, then shrink it to a communicator of their own, and
 *              all-reduce on each.
 *   check layout   prints what the header says of the ABI, for the test to compare. */
#include <signal.h>
#include <stddef.h>
#include <string.h>

#include "ranks.h"

static void run(ncclUniqueId id) {
  ncclComm_t comm;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  /* Odd ranks set up without blocking, and wait for it as NCCL's users do. */
  config.blocking = rank % 2 == 0;
  ncclResult_t init = ncclCommInitRankConfig(&comm, nranks, id, rank, &config);
  EXPECT(init == ncclSuccess || (init == ncclInProgress && !config.blocking));
  ncclResult_t state = init;
  while (state == ncclInProgress) {
    CHECK(ncclCommGetAsyncError(comm, &state));
    usleep(1000);
  }
  EXPECT(state == ncclSuccess);
  int count, me;
  CHECK(ncclCommCount(comm, &count));
  CHECK(ncclCommUserRank(comm, &me));
  EXPECT(count == nranks && me == rank);

  enum { N = 4099 };
  float *in = malloc(N * sizeof(float)), *out = malloc(N * sizeof(float));
  for (int i = 0; i < N; i++) in[i] = (float)(rank + i % 7);
  CHECK(ncclAllReduce(in, out, N, ncclFloat, ncclSum, comm, NULL));
  for (int i = 0; i < N; i++) EXPECT(out[i] == (float)(nranks * (nranks - 1) / 2 + nranks * (i % 7)));

  int *ints = malloc(N * sizeof(int));
  for (int i = 0; i < N; i++) ints[i] = rank == nranks - 1 ? 3 * i : -1;
  CHECK(ncclBcast(ints, N, ncclInt, nranks - 1, comm, NULL));
  for (int i = 0; i < N; i++) EXPECT(ints[i] == 3 * i);

  /* Reduce to rank 0; the others pass no output. */
  double mine = rank + 1, sum = 0;
  CHECK(ncclReduce(&mine, rank == 0 ? &sum : NULL, 1, ncclDouble, ncclSum, 0, comm, NULL));
  if (rank == 0) EXPECT(sum == nranks * (nranks + 1) / 2.0);

  /* All-gather in place, then reduce-scatter it back. */
  long long *all = calloc(nranks, sizeof(long long));
  all[rank] = 100 + rank;
  CHECK(ncclAllGather(all + rank, all, 1, ncclInt64, comm, NULL));
  for (int r = 0; r < nranks; r++) EXPECT(all[r] == 100 + r);
  long long part = 0;
  CHECK(ncclReduceScatter(all, &part, 1, ncclInt64, ncclMax, comm, NULL));
  EXPECT(part == 100 + rank);

  /* A ring of sends and receives in one group. */
  int to = (rank + 1) % nranks, from = (rank + nranks - 1) % nranks, got = -1, sent = 1000 + rank;
  CHECK(ncclGroupStart());
  CHECK(ncclSend(&sent, 1, ncclInt32, to, comm, NULL));
  CHECK(ncclRecv(&got, 1, ncclInt32, from, comm, NULL));
  CHECK(ncclGroupEnd());
  EXPECT(got == 1000 + from);

  /* Split by parity, ranks reversed. */
  ncclComm_t half;
  CHECK(ncclCommSplit(comm, rank % 2, -rank, &half, NULL));
  int hcount, hrank;
  CHECK(ncclCommCount(half, &hcount));
  CHECK(ncclCommUserRank(half, &hrank));
  EXPECT(hcount == (nranks + 1 - rank % 2) / 2);
  float one = 1;
  CHECK(ncclAllReduce(&one, &one, 1, ncclFloat32, ncclSum, half, NULL));
  EXPECT(one == (float)hcount);
  CHECK(ncclCommDestroy(half));

  /* What Chorus lacks fails by name. */
  EXPECT(ncclAllReduce(in, out, 1, ncclFloat8e4m3, ncclSum, comm, NULL) == ncclInvalidArgument);
  EXPECT(strstr(ncclGetLastError(comm), "e4m3") != NULL);

  CHECK(ncclCommFinalize(comm));
  CHECK(ncclCommDestroy(comm));
  printf("rank %d of %d ok\n", rank, nranks);
}

/* One rank of `check kill`: the last rank dies after the first all-reduce. */
static void survive(ncclUniqueId id) {
  ncclComm_t comm;
  CHECK(ncclCommInitRank(&comm, nranks, id, rank));
  int victim = nranks - 1, one = 1;
  CHECK(ncclAllReduce(&one, &one, 1, ncclInt32, ncclSum, comm, NULL));
  EXPECT(one == nranks);
  if (rank == victim) raise(SIGKILL);
  one = 1;
  ncclResult_t after = ncclAllReduce(&one, &one, 1, ncclInt32, ncclSum, comm, NULL);
  EXPECT(after == ncclRemoteError);
  ncclResult_t state;
  CHECK(ncclCommGetAsyncError(comm, &state));
  EXPECT(state == ncclRemoteError);
  char named[32];
  snprintf(named, sizeof named, "rank %d", victim);
  if (strstr(ncclGetLastError(comm), named) == NULL) {
    fprintf(stderr, "rank %d: the async error does not name %s: %s\n", rank, named, ncclGetLastError(comm));
    exit(3);
  }
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  /* Revoked, the communicator takes no calls, reports success once quiescent, and splits
   * among the survivors (here in reverse order of rank). */
  CHECK(ncclCommRevoke(comm, NCCL_REVOKE_DEFAULT));
  EXPECT(ncclAllReduce(&one, &one, 1, ncclInt32, ncclSum, comm, NULL) == ncclInvalidUsage);
  EXPECT(strstr(ncclGetLastError(comm), "revoked") != NULL);
  CHECK(ncclCommGetAsyncError(comm, &state));
  EXPECT(state == ncclSuccess);
  ncclComm_t reversed;
  CHECK(ncclCommSplit(comm, 0, -rank, &reversed, NULL));
  int size, place, value = rank;
  CHECK(ncclCommCount(reversed, &size));
  CHECK(ncclCommUserRank(reversed, &place));
  EXPECT(size == nranks - 1 && place == nranks - 2 - rank);
  CHECK(ncclAllReduce(&value, &value, 1, ncclInt32, ncclMax, reversed, NULL));
  EXPECT(value == nranks - 2);
  CHECK(ncclCommDestroy(reversed));
#endif
  ncclComm_t survivors;
  CHECK(ncclCommShrink(comm, NULL, 0, &survivors, NULL, NCCL_SHRINK_DEFAULT));
  int count, me;
  CHECK(ncclCommCount(survivors, &count));
  CHECK(ncclCommUserRank(survivors, &me));
  EXPECT(count == nranks - 1 && me == rank);
  int mine = rank + 1;
  CHECK(ncclAllReduce(&mine, &mine, 1, ncclInt32, ncclSum, survivors, NULL));
  EXPECT(mine == (nranks - 1) * nranks / 2);
  CHECK(ncclCommAbort(comm));
  CHECK(ncclCommDestroy(survivors));
  printf("rank %d of %d survived\n", rank, nranks);
}

int main(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "layout") == 0) {
    int version = 0;
    CHECK(ncclGetVersion(&version));
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 3)
    int timeout = (int)ncclTimeout;
#else
    int timeout = -1;
#endif
    printf("header %d library %d config %zu blocking %zu commName %zu uniqueId %zu float8e4m3 %d avg %d "
           "timeout %d\n",
           NCCL_VERSION_CODE, version, sizeof(ncclConfig_t), offsetof(ncclConfig_t, blocking),
           offsetof(ncclConfig_t, commName), sizeof(ncclUniqueId), (int)ncclFloat8e4m3, (int)ncclAvg,
           timeout);
    return 0;
  }
  int killing = argc == 3 && strcmp(argv[1], "kill") == 0;
  nranks = argc == 2 ? atoi(argv[1]) : killing ? atoi(argv[2]) : 0;
  if (nranks < 1 || (killing && nranks < 3)) return 1;
  return run_ranks(killing ? survive : run, killing ? nranks - 1 : -1);
}
