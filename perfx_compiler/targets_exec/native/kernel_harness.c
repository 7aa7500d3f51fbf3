/*
 * Run compiled TVM PrimFuncs from a shared library without any TVM runtime (cross-compiled, under qemu-user).
 *
 * A PrimFunc compiled by TVM's LLVM backend exports `__tvm_ffi_<name>` with the TVM-FFI safe-call ABI
 * (handle, TVMFFIAny args[], num_args, TVMFFIAny* result) and needs, from a runtime:
 *   - TVMFFIErrorSetRaisedFromCStrParts   (argument check failures): defined here, exported (-rdynamic)
 *   - __TVMBackendParallelLaunch / __TVMBackendParallelBarrier / __TVMBackendAllocWorkspace /
 *     __TVMBackendFreeWorkspace: function-pointer slots in the library that a runtime fills at load;
 *     this harness fills them with a serial launcher (every task of a parallel loop runs in turn, so the
 *     kernel's work split is exercised) and malloc/free.
 *
 * usage: kernel_harness LIB.so PLAN
 * PLAN is a text file of calls:
 *   call NAME NARGS
 *   t CODE BITS NDIM D0 .. Dn-1 IN_PATH OUT_PATH     tensor (DLPack dtype code/bits), raw bytes in/out
 *   i VALUE                                          int64 scalar
 *   f VALUE                                          float64 scalar
 * Every tensor is written back to OUT_PATH after its call (in-place outputs included).
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tvm/ffi/c_api.h>

#define MAX_ARGS 64
#define MAX_DIMS 8

typedef struct {
  void* sync_handle;
  int32_t num_task;
} ParallelGroupEnv;
typedef int (*ParallelLambda)(int task_id, ParallelGroupEnv* penv, void* cdata);

static char g_error[4096];
static int g_num_task = 4;

void TVMFFIErrorSetRaisedFromCStrParts(const char* kind, const char** parts, int32_t num_parts) {
  size_t n = (size_t)snprintf(g_error, sizeof(g_error), "%s: ", kind ? kind : "Error");
  for (int32_t i = 0; i < num_parts && n < sizeof(g_error); ++i) {
    n += (size_t)snprintf(g_error + n, sizeof(g_error) - n, "%s", parts[i] ? parts[i] : "");
  }
}

static int serial_parallel_launch(ParallelLambda flambda, void* cdata, int num_task) {
  ParallelGroupEnv env;
  env.sync_handle = NULL;
  env.num_task = num_task > 0 ? num_task : g_num_task;
  for (int i = 0; i < env.num_task; ++i) {
    int rc = flambda(i, &env, cdata);
    if (rc != 0) return rc;
  }
  return 0;
}

static int serial_barrier(int task_id, ParallelGroupEnv* penv) {
  (void)task_id;
  (void)penv;
  return 0;
}

static void* alloc_workspace(int device_type, int device_id, uint64_t nbytes, int code, int bits) {
  (void)device_type;
  (void)device_id;
  (void)code;
  (void)bits;
  void* p = NULL;
  if (posix_memalign(&p, 64, nbytes ? (size_t)nbytes : 64) != 0) return NULL;
  return p;
}

static int free_workspace(int device_type, int device_id, void* ptr) {
  (void)device_type;
  (void)device_id;
  free(ptr);
  return 0;
}

static void set_slot(void* lib, const char* name, void* fn) {
  void** slot = (void**)dlsym(lib, name);
  if (slot != NULL) *slot = fn;
}

static size_t read_file(const char* path, void* dst, size_t nbytes) {
  FILE* f = fopen(path, "rb");
  if (f == NULL) return 0;
  size_t got = fread(dst, 1, nbytes, f);
  fclose(f);
  return got;
}

static int write_file(const char* path, const void* src, size_t nbytes) {
  FILE* f = fopen(path, "wb");
  if (f == NULL) return -1;
  size_t put = fwrite(src, 1, nbytes, f);
  fclose(f);
  return put == nbytes ? 0 : -1;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s LIB.so PLAN\n", argv[0]);
    return 2;
  }
  const char* env_tasks = getenv("PERFX_NUM_TASK");
  if (env_tasks != NULL) g_num_task = atoi(env_tasks);
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
    return 3;
  }
  set_slot(lib, "__TVMBackendParallelLaunch", (void*)serial_parallel_launch);
  set_slot(lib, "__TVMBackendParallelBarrier", (void*)serial_barrier);
  set_slot(lib, "__TVMBackendAllocWorkspace", (void*)alloc_workspace);
  set_slot(lib, "__TVMBackendFreeWorkspace", (void*)free_workspace);
  FILE* plan = fopen(argv[2], "r");
  if (plan == NULL) {
    fprintf(stderr, "cannot open plan %s\n", argv[2]);
    return 2;
  }
  char word[16], name[512];
  int nargs, calls = 0;
  while (fscanf(plan, "%15s %511s %d", word, name, &nargs) == 3) {
    if (strcmp(word, "call") != 0 || nargs > MAX_ARGS) {
      fprintf(stderr, "bad plan line near call %d\n", calls);
      return 2;
    }
    char sym[600];
    snprintf(sym, sizeof(sym), "__tvm_ffi_%s", name);
    TVMFFISafeCallType fn = (TVMFFISafeCallType)dlsym(lib, sym);
    if (fn == NULL) {
      fprintf(stderr, "symbol %s not found\n", sym);
      return 4;
    }
    TVMFFIAny args[MAX_ARGS];
    DLTensor tensors[MAX_ARGS];
    int64_t shapes[MAX_ARGS][MAX_DIMS];
    char out_paths[MAX_ARGS][512];
    size_t nbytes[MAX_ARGS];
    memset(args, 0, sizeof(args));
    for (int a = 0; a < nargs; ++a) {
      char kind[4];
      out_paths[a][0] = 0;
      if (fscanf(plan, "%3s", kind) != 1) return 2;
      if (kind[0] == 'i') {
        long long v;
        if (fscanf(plan, "%lld", &v) != 1) return 2;
        args[a].type_index = kTVMFFIInt;
        args[a].v_int64 = (int64_t)v;
      } else if (kind[0] == 'f') {
        double v;
        if (fscanf(plan, "%lf", &v) != 1) return 2;
        args[a].type_index = kTVMFFIFloat;
        args[a].v_float64 = v;
      } else {
        int code, bits, ndim;
        char in_path[512];
        if (fscanf(plan, "%d %d %d", &code, &bits, &ndim) != 3 || ndim > MAX_DIMS) return 2;
        size_t count = 1;
        for (int d = 0; d < ndim; ++d) {
          long long dim;
          if (fscanf(plan, "%lld", &dim) != 1) return 2;
          shapes[a][d] = (int64_t)dim;
          count *= (size_t)dim;
        }
        if (fscanf(plan, "%511s %511s", in_path, out_paths[a]) != 2) return 2;
        nbytes[a] = count * (size_t)(bits / 8);
        void* data = alloc_workspace(1, 0, nbytes[a] + 64, code, bits);
        if (nbytes[a] && read_file(in_path, data, nbytes[a]) != nbytes[a]) {
          fprintf(stderr, "short read %s\n", in_path);
          return 5;
        }
        DLTensor* t = &tensors[a];
        memset(t, 0, sizeof(*t));
        t->data = data;
        t->device.device_type = kDLCPU;
        t->device.device_id = 0;
        t->ndim = ndim;
        t->dtype.code = (uint8_t)code;
        t->dtype.bits = (uint8_t)bits;
        t->dtype.lanes = 1;
        t->shape = shapes[a];
        t->strides = NULL;
        t->byte_offset = 0;
        args[a].type_index = kTVMFFIDLTensorPtr;
        args[a].v_ptr = t;
      }
    }
    TVMFFIAny result;
    memset(&result, 0, sizeof(result));
    result.type_index = kTVMFFINone;
    g_error[0] = 0;
    int rc = fn(NULL, args, nargs, &result);
    if (rc != 0) {
      fprintf(stderr, "%s returned %d: %s\n", name, rc, g_error);
      return 6;
    }
    for (int a = 0; a < nargs; ++a) {
      if (args[a].type_index != kTVMFFIDLTensorPtr) continue;
      if (write_file(out_paths[a], tensors[a].data, nbytes[a]) != 0) {
        fprintf(stderr, "cannot write %s\n", out_paths[a]);
        return 5;
      }
      free(tensors[a].data);
    }
    ++calls;
  }
  fclose(plan);
  printf("kernel_harness: %d calls ok\n", calls);
  return 0;
}
