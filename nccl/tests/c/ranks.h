/* What the test programs share: the calling rank, NCCL's and the tests' checks, and ranks made
 * as forked processes that get rank 0's unique id through pipes. */
#ifndef CHORUS_NCCL_TEST_RANKS_H
#define CHORUS_NCCL_TEST_RANKS_H

#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static int rank, nranks;

#define CHECK(call)                                                                           \
  do {                                                                                        \
    ncclResult_t r_ = (call);                                                                 \
    if (r_ != ncclSuccess) {                                                                  \
      fprintf(stderr, "rank %d: %s failed: %s (%s)\n", rank, #call, ncclGetErrorString(r_),   \
              ncclGetLastError(NULL));                                                        \
      exit(2);                                                                                \
    }                                                                                         \
  } while (0)

#define EXPECT(cond)                                                                          \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      fprintf(stderr, "rank %d: line %d: %s is false\n", rank, __LINE__, #cond);              \
      exit(3);                                                                                \
    }                                                                                         \
  } while (0)

/* Runs `body` on `nranks` ranks: ranks 1.. forked before any NCCL or CUDA call (a CUDA context
 * does not survive fork), rank 0 in this process, which makes the unique id. Returns 0 when every
 * forked rank exited 0, but for rank `killed` (-1: none), which must have died of a signal. */
static int run_ranks(void (*body)(ncclUniqueId), int killed) {
  int pipes[64][2];
  pid_t pids[64];
  if (nranks < 1 || nranks > 64) return 1;
  for (int r = 1; r < nranks; r++) {
    if (pipe(pipes[r]) != 0) return 1;
    pids[r] = fork();
    if (pids[r] == 0) {
      rank = r;
      ncclUniqueId id;
      if (read(pipes[r][0], &id, sizeof id) != (ssize_t)sizeof id) exit(1);
      body(id);
      exit(0);
    }
  }
  rank = 0;
  ncclUniqueId id;
  CHECK(ncclGetUniqueId(&id));
  for (int r = 1; r < nranks; r++)
    if (write(pipes[r][1], &id, sizeof id) != (ssize_t)sizeof id) return 1;
  body(id);
  int failed = 0;
  for (int r = 1; r < nranks; r++) {
    int status;
    waitpid(pids[r], &status, 0);
    if (r == killed ? !WIFSIGNALED(status) : !WIFEXITED(status) || WEXITSTATUS(status) != 0) failed = 1;
  }
  return failed;
}

#endif
