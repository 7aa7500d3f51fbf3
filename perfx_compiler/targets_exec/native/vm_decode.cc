// Run a PerfX artifact's `decode` function with the TVM runtime alone (no Python): used to run
// cross-compiled builds (aarch64) under qemu-user with the runtime libraries of PyPI's aarch64 wheels.
//
//   vm_decode MODEL.so PLAN.txt OUT.bin TOKEN...
//
// PLAN.txt: one line per Relax argument after (input_ids, past_len), in order:
//   <dtype: f32|f16|i64|i32|u32|i8|u8> <ndim> <dims...> <file|-> <byte offset> <nbytes>      ("-": zeros)
// OUT.bin: the float32 logits of every step, concatenated.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

using tvm::ffi::Any;
using tvm::ffi::AnyView;
using tvm::ffi::Function;
using tvm::ffi::Module;
using tvm::ffi::Tensor;

struct Buf {
  std::vector<int64_t> shape;
  DLDataType dtype;
  void* data;
  size_t nbytes;
};

static void NoDelete(DLManagedTensor*) {}

static Tensor Wrap(Buf* b) {
  auto* mt = new DLManagedTensor();
  std::memset(mt, 0, sizeof(*mt));
  mt->dl_tensor.data = b->data;
  mt->dl_tensor.device = DLDevice{kDLCPU, 0};
  mt->dl_tensor.ndim = static_cast<int32_t>(b->shape.size());
  mt->dl_tensor.dtype = b->dtype;
  mt->dl_tensor.shape = b->shape.data();
  mt->deleter = NoDelete;
  return Tensor::FromDLPack(mt);
}

static Buf* NewBuf(const std::string& dt, std::vector<int64_t> shape) {
  auto* b = new Buf();
  b->shape = std::move(shape);
  // dtype names as the plan writes them (targets_exec/qemu.py): f32, f16, i64, i32, u32, i8, u8
  const uint8_t code = dt[0] == 'f' ? kDLFloat : dt[0] == 'u' ? kDLUInt : kDLInt;
  b->dtype = DLDataType{code, static_cast<uint8_t>(std::stoi(dt.substr(1))), 1};
  size_t n = 1;
  for (int64_t d : b->shape) n *= static_cast<size_t>(d);
  b->nbytes = n * (b->dtype.bits / 8);
  b->data = std::aligned_alloc(64, (b->nbytes + 63) / 64 * 64 + 64);
  std::memset(b->data, 0, b->nbytes);
  return b;
}

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: vm_decode MODEL.so PLAN.txt OUT.bin TOKEN...\n");
    return 2;
  }
  Module lib = Module::LoadFromFile(argv[1]);
  Module vm = lib->GetFunction("vm_load_executable").value()().cast<Module>();
  vm->GetFunction("vm_initialization").value()(static_cast<int>(kDLCPU), 0, 2);
  Function decode = vm->GetFunction("decode").value();

  std::vector<Tensor> tail;
  std::ifstream plan(argv[2]);
  std::string line;
  while (std::getline(plan, line)) {
    if (line.empty()) continue;
    std::istringstream in(line);
    std::string dt, file;
    int ndim;
    in >> dt >> ndim;
    std::vector<int64_t> shape(ndim);
    for (auto& d : shape) in >> d;
    long long offset, nbytes;
    in >> file >> offset >> nbytes;
    Buf* b = NewBuf(dt, shape);
    if (file != "-") {
      std::ifstream f(file, std::ios::binary);
      f.seekg(offset);
      f.read(static_cast<char*>(b->data), nbytes);
      if (!f) {
        std::fprintf(stderr, "cannot read %s at %lld\n", file.c_str(), offset);
        return 1;
      }
    }
    tail.push_back(Wrap(b));
  }
  Buf* ids = NewBuf("i64", {1, 1});
  Buf* past = NewBuf("i64", {1});
  Tensor ids_t = Wrap(ids), past_t = Wrap(past);
  std::FILE* out = std::fopen(argv[3], "wb");
  for (int i = 4; i < argc; ++i) {
    static_cast<int64_t*>(ids->data)[0] = std::atoll(argv[i]);
    static_cast<int64_t*>(past->data)[0] = i - 4;
    std::vector<AnyView> args;
    args.push_back(ids_t);
    args.push_back(past_t);
    for (auto& t : tail) args.push_back(t);
    Any result;
    decode.CallPacked(args.data(), static_cast<int32_t>(args.size()), &result);
    Tensor logits = result.cast<tvm::ffi::Array<Any>>()[0].cast<Tensor>();
    std::fwrite(logits.data_ptr(), sizeof(float), static_cast<size_t>(logits.numel()), out);
  }
  std::fclose(out);
  std::printf("ok %d steps\n", argc - 4);
  return 0;
}
