// The fuzz targets without libFuzzer: a main() that runs LLVMFuzzerTestOneInput once on every
// file named, and on every file in every directory named (sorted), so that a plain compiler
// (g++, under AddressSanitizer and UBSan) replays the committed corpora in `make test`
// (tests/test_fuzz_corpus.py). A finding ends the process (abort, or the sanitizer's report
// with -fno-sanitize-recover=all); exit status 0 means every input ran clean.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::vector<fs::path> inputs;
  for (int i = 1; i < argc; ++i) {
    const fs::path p(argv[i]);
    if (fs::is_directory(p)) {
      for (const auto& e : fs::directory_iterator(p))
        if (e.is_regular_file()) inputs.push_back(e.path());
    } else {
      inputs.push_back(p);
    }
  }
  std::sort(inputs.begin(), inputs.end());
  for (const fs::path& p : inputs) {
    std::ifstream f(p, std::ios::binary);
    if (!f) {
      std::fprintf(stderr, "replay: cannot read %s\n", p.c_str());
      return 2;
    }
    std::vector<char> b((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::fprintf(stderr, "replay: %s\n", p.c_str());
    // a copy of its own size: the sanitizers see a read past its end
    std::vector<uint8_t> exact(b.begin(), b.end());
    LLVMFuzzerTestOneInput(exact.data(), exact.size());
  }
  std::printf("replayed %zu inputs\n", inputs.size());
  return 0;
}
