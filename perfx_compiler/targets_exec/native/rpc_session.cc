// One TVM RPC session served by the TVM runtime alone (no Python): the device side of
// perfx_compiler/targets_exec/qemu_rpc.py, cross-compiled for aarch64 and run under qemu-user.
//
//   rpc_session SOCKET_FD WORKDIR
//
// The launcher (host Python, like TVM's own rpc_server parent process) registers with the tracker,
// accepts the client and does the key handshake, then hands the connected socket to this program,
// which runs libtvm_runtime's RPC server loop on it: uploads, module loads, tensor copies and
// time_evaluator all execute on the aarch64 runtime. libtvm_runtime registers upload/download/remove
// itself; a server must provide the work folder and the module loader (TVM's Python server does
// the same in rpc/server.py).
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <cstdio>
#include <cstdlib>
#include <string>

using tvm::ffi::Function;
using tvm::ffi::Module;
using tvm::ffi::String;

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: rpc_session SOCKET_FD WORKDIR\n");
    return 2;
  }
  const int fd = std::atoi(argv[1]);
  const std::string work = argv[2];
  Function::SetGlobal("tvm.rpc.server.workpath",
                      Function::FromTyped([work](String name) -> String { return work + "/" + std::string(name); }),
                      true);
  Function::SetGlobal("tvm.rpc.server.load_module", Function::FromTyped([work](String name) -> Module {
                        return Module::LoadFromFile(work + "/" + std::string(name));
                      }),
                      true);
  auto loop = Function::GetGlobal("rpc.ServerLoop");
  if (!loop.has_value()) {
    std::fprintf(stderr, "rpc_session: this libtvm_runtime has no rpc.ServerLoop\n");
    return 1;
  }
  (*loop)(static_cast<int64_t>(fd));
  return 0;
}
