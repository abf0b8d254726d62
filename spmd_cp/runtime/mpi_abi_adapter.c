/*
 * Open MPI's ABI over an MPICH-family library, for MLX's MPI backend.
 *
 * MLX's MPI backend (mlx/distributed/mpi) dlopens a libmpi, checks that its version
 * string names Open MPI, and takes Open MPI's handles: communicators, datatypes and ops
 * are pointers, the predefined ones the addresses of exported objects such as
 * ompi_mpi_comm_world, MPI_IN_PLACE is (void*)1. MPICH's handles are ints and its
 * MPI_IN_PLACE is (void*)-1. This library exports the names MLX looks up and forwards
 * every call to the MPICH library that mpi4py already loaded (its PMPI_ entry points,
 * found with dlsym after spmd_cp_bind), translating handles on the way:
 *
 *   - the predefined objects below are decoded by address;
 *   - every handle MPICH creates (a split communicator, a contiguous type, a user op) is
 *     handed to MLX as the pointer value of its int, and decoded the same way back.
 *
 * Why: MLX then runs decode's small collectives on its compute thread through MPICH's
 * shared-memory transport (a few microseconds), where its ring backend hands each one
 * across three threads and a TCP socket (tens of microseconds).
 *
 * "MPI_COMM_WORLD" for MLX is the communicator spmd_cp_bind names (a duplicate of the
 * job's), so MLX's messages never meet the Python side's. MPI_Init and MPI_Finalize do
 * nothing: mpi4py owns MPI's lifetime. Only what MLX calls is here.
 */

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef int mpich_handle;

/* Open MPI's predefined objects: only their addresses matter. */
#define PREDEFINED(name) char name[8]
PREDEFINED(ompi_mpi_comm_world);
PREDEFINED(ompi_mpi_op_sum);
PREDEFINED(ompi_mpi_op_max);
PREDEFINED(ompi_mpi_op_min);
PREDEFINED(ompi_mpi_c_bool);
PREDEFINED(ompi_mpi_int8_t);
PREDEFINED(ompi_mpi_uint8_t);
PREDEFINED(ompi_mpi_int16_t);
PREDEFINED(ompi_mpi_uint16_t);
PREDEFINED(ompi_mpi_int32_t);
PREDEFINED(ompi_mpi_uint32_t);
PREDEFINED(ompi_mpi_int64_t);
PREDEFINED(ompi_mpi_uint64_t);
PREDEFINED(ompi_mpi_float);
PREDEFINED(ompi_mpi_double);
PREDEFINED(ompi_mpi_c_complex);

/* The order spmd_cp_bind's handle array follows (see mpi_abi.py). */
static void *const predefined[] = {
    ompi_mpi_comm_world, ompi_mpi_op_sum,    ompi_mpi_op_max,   ompi_mpi_op_min,
    ompi_mpi_c_bool,     ompi_mpi_int8_t,    ompi_mpi_uint8_t,  ompi_mpi_int16_t,
    ompi_mpi_uint16_t,   ompi_mpi_int32_t,   ompi_mpi_uint32_t, ompi_mpi_int64_t,
    ompi_mpi_uint64_t,   ompi_mpi_float,     ompi_mpi_double,   ompi_mpi_c_complex,
};
#define N_PREDEFINED (sizeof(predefined) / sizeof(predefined[0]))
static mpich_handle predefined_handles[N_PREDEFINED];

#define OMPI_IN_PLACE ((void *)1)
static void *mpich_in_place;

static int (*p_allreduce)(const void *, void *, int, mpich_handle, mpich_handle,
                          mpich_handle);
static int (*p_allgather)(const void *, int, mpich_handle, void *, int, mpich_handle,
                          mpich_handle);
static int (*p_send)(const void *, int, mpich_handle, int, int, mpich_handle);
static int (*p_recv)(void *, int, mpich_handle, int, int, mpich_handle, void *);
static int (*p_comm_rank)(mpich_handle, int *);
static int (*p_comm_size)(mpich_handle, int *);
static int (*p_comm_split)(mpich_handle, int, int, mpich_handle *);
static int (*p_comm_free)(mpich_handle *);
static int (*p_type_contiguous)(int, mpich_handle, mpich_handle *);
static int (*p_type_commit)(mpich_handle *);
static int (*p_op_create)(void *, int, mpich_handle *);
static int bound;

#define NOT_BOUND 16 /* MPI_ERR_OTHER in both families */

static mpich_handle decode(void *handle) {
  for (size_t i = 0; i < N_PREDEFINED; i++)
    if (handle == predefined[i]) return predefined_handles[i];
  return (mpich_handle)(intptr_t)handle;
}

static void *encode(mpich_handle handle) { return (void *)(intptr_t)handle; }

/* Called once from Python before MLX opens its MPI backend: the MPICH library's path,
 * MPICH's MPI_IN_PLACE, and the handles of the predefined objects in `predefined`
 * order. Returns 0, -1 when the library does not open, or the index + 1 of the first
 * entry point it lacks. */
int spmd_cp_bind(const char *library, intptr_t in_place, const int *handles) {
  void *mpich = dlopen(library, RTLD_NOW | RTLD_NOLOAD);
  if (mpich == NULL) mpich = dlopen(library, RTLD_NOW);
  if (mpich == NULL) return -1;
  const char *names[] = {"PMPI_Allreduce",       "PMPI_Allgather",   "PMPI_Send",
                         "PMPI_Recv",            "PMPI_Comm_rank",   "PMPI_Comm_size",
                         "PMPI_Comm_split",      "PMPI_Comm_free",   "PMPI_Type_contiguous",
                         "PMPI_Type_commit",     "PMPI_Op_create"};
  void **slots[] = {(void **)&p_allreduce,       (void **)&p_allgather,
                    (void **)&p_send,            (void **)&p_recv,
                    (void **)&p_comm_rank,       (void **)&p_comm_size,
                    (void **)&p_comm_split,      (void **)&p_comm_free,
                    (void **)&p_type_contiguous, (void **)&p_type_commit,
                    (void **)&p_op_create};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
    *slots[i] = dlsym(mpich, names[i]);
    if (*slots[i] == NULL) return (int)i + 1;
  }
  memcpy(predefined_handles, handles, sizeof(predefined_handles));
  mpich_in_place = (void *)in_place;
  bound = 1;
  return 0;
}

int MPI_Get_library_version(char *version, int *length) {
  *length = snprintf(version, 256, "Open MPI ABI adapter over MPICH (spmd-cp)");
  return 0;
}

int MPI_Init(int *argc, char ***argv) { return bound ? 0 : NOT_BOUND; }
int MPI_Finalize(void) { return 0; }

int MPI_Comm_rank(void *comm, int *rank) { return p_comm_rank(decode(comm), rank); }
int MPI_Comm_size(void *comm, int *size) { return p_comm_size(decode(comm), size); }

int MPI_Comm_split(void *comm, int color, int key, void **out) {
  mpich_handle made;
  int error = p_comm_split(decode(comm), color, key, &made);
  *out = encode(made);
  return error;
}

int MPI_Comm_free(void **comm) {
  mpich_handle handle = decode(*comm);
  return p_comm_free(&handle);
}

int MPI_Type_contiguous(int count, void *type, void **out) {
  mpich_handle made;
  int error = p_type_contiguous(count, decode(type), &made);
  *out = encode(made);
  return error;
}

int MPI_Type_commit(void **type) {
  mpich_handle handle = decode(*type);
  int error = p_type_commit(&handle);
  *type = encode(handle);
  return error;
}

int MPI_Op_create(void *function, int commute, void **out) {
  /* MLX's reductions ignore their datatype argument, so MPICH's int handle there is
   * harmless. */
  mpich_handle made;
  int error = p_op_create(function, commute, &made);
  *out = encode(made);
  return error;
}

int MPI_Allreduce(const void *send, void *recv, int count, void *type, void *op,
                  void *comm) {
  if (send == OMPI_IN_PLACE) send = mpich_in_place;
  return p_allreduce(send, recv, count, decode(type), decode(op), decode(comm));
}

int MPI_Allgather(const void *send, int send_count, void *send_type, void *recv,
                  int recv_count, void *recv_type, void *comm) {
  if (send == OMPI_IN_PLACE) send = mpich_in_place;
  return p_allgather(send, send_count, decode(send_type), recv, recv_count,
                     decode(recv_type), decode(comm));
}

int MPI_Send(const void *buffer, int count, void *type, int destination, int tag,
             void *comm) {
  return p_send(buffer, count, decode(type), destination, tag, decode(comm));
}

int MPI_Recv(void *buffer, int count, void *type, int source, int tag, void *comm,
             void *status) {
  char mpich_status[64]; /* MPICH's MPI_Status is 20 bytes; MLX ignores it */
  return p_recv(buffer, count, decode(type), source, tag, decode(comm), mpich_status);
}
