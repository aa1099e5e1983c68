#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "io/safetensors.h"
#include "support/test_support.h"

namespace dtune::io {
namespace {

std::string le64(uint64_t n) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return s;
}

// A file with the given header JSON text and `data_bytes` bytes of data.
std::string raw_file(const std::string& header, std::size_t data_bytes) {
    return le64(header.size()) + header + std::string(data_bytes, '\x01');
}

// Expects opening `bytes` as a safetensors file to throw a DataError mentioning every needle.
void expect_rejected(const std::string& bytes, std::initializer_list<const char*> needles) {
    test::TempDir dir;
    const auto path = dir / "bad.safetensors";
    test::write_bytes(path, bytes);
    try {
        SafetensorsFile f(path);
        ADD_FAILURE() << "accepted a malformed file";
    } catch (const DataError& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("bad.safetensors"), std::string::npos) << msg;
        for (const char* n : needles)
            EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
    }
}

}  // namespace

TEST(Safetensors, RoundTripsEveryDType) {
    test::TempDir dir;
    at::manual_seed(1);
    const at::Tensor base = at::randn({3, 5}) * 10;
    TensorList tensors = {
        {"f64", base.to(at::kDouble)},
        {"f32", base},
        {"f16", base.to(at::kHalf)},
        {"bf16", base.to(at::kBFloat16)},
        {"f8_e4m3", (base / 40).to(at::ScalarType::Float8_e4m3fn)},
        {"f8_e5m2", base.to(at::ScalarType::Float8_e5m2)},
        {"i64", base.to(at::kLong)},
        {"i32", base.to(at::kInt)},
        {"i16", base.to(at::kShort)},
        {"i8", base.to(at::kChar)},
        {"u8", base.abs().to(at::kByte)},
        {"bool", base > 0},
        {"scalar", at::scalar_tensor(3.5)},
        {"empty", at::empty({0, 4})},
        {"noncontig", base.t()},
    };
    save_safetensors(dir / "all.safetensors", tensors, {{"format", "pt"}, {"note", "ünïcode ✓"}});
    SafetensorsFile f(dir / "all.safetensors");
    EXPECT_EQ(f.keys().size(), tensors.size());
    EXPECT_EQ(f.metadata().at("note"), "ünïcode ✓");
    for (const auto& [name, t] : tensors) {
        at::Tensor got = f.get(name);
        EXPECT_EQ(got.scalar_type(), t.scalar_type()) << name;
        EXPECT_EQ(got.sizes(), t.sizes()) << name;
        // Compare bytes through a float view where equality is defined for the dtype.
        if (t.scalar_type() == at::ScalarType::Float8_e4m3fn ||
            t.scalar_type() == at::ScalarType::Float8_e5m2)
            EXPECT_TRUE(at::equal(got.to(at::kFloat), t.to(at::kFloat))) << name;
        else
            EXPECT_TRUE(at::equal(got, t.contiguous())) << name;
    }
    EXPECT_EQ(f.info("f32").dtype, StDType::F32);
    EXPECT_EQ(f.info("f8_e5m2").dtype, StDType::F8_E5M2);
}

TEST(Safetensors, TensorsViewTheMappingWithoutCopyAndOutliveTheFile) {
    test::TempDir dir;
    at::Tensor big = at::arange(1 << 16, at::kFloat);
    save_safetensors(dir / "v.safetensors", {{"x", big}});
    at::Tensor view;
    {
        SafetensorsFile f(dir / "v.safetensors");
        view = f.get("x");
        at::Tensor again = f.get("x");
        EXPECT_EQ(view.data_ptr(), again.data_ptr()) << "both reads must view the same mapped bytes";
    }
    EXPECT_TRUE(at::equal(view, big));  // the mapping outlives SafetensorsFile
    view.mul_(2);                       // copy-on-write: the file is not changed
    EXPECT_TRUE(at::equal(SafetensorsFile(dir / "v.safetensors").get("x"), big));
}

TEST(Safetensors, HeaderIsEightByteAlignedAndSpecShaped) {
    test::TempDir dir;
    save_safetensors(dir / "h.safetensors", {{"w", at::ones({2, 2})}}, {{"k", "v"}});
    const std::string bytes = fs::read_file(dir / "h.safetensors");
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
    EXPECT_EQ((8 + n) % 8, 0u);
    EXPECT_EQ(bytes.size(), 8 + n + 16);
    auto header = nlohmann::json::parse(bytes.substr(8, n));
    EXPECT_EQ(header["w"]["dtype"], "F32");
    EXPECT_EQ(header["w"]["shape"], nlohmann::json({2, 2}));
    EXPECT_EQ(header["w"]["data_offsets"], nlohmann::json({0, 16}));
    EXPECT_EQ(header["__metadata__"]["k"], "v");
}

TEST(Safetensors, RejectsMalformedFiles) {
    const std::string good = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
    expect_rejected("", {"shorter than the 8-byte"});
    expect_rejected("abc", {"shorter than the 8-byte"});
    expect_rejected(le64(1000) + "{}", {"claims 1000 bytes", "only 2 follow"});
    expect_rejected(le64(uint64_t(1) << 40) + "{}", {"100 MiB"});
    expect_rejected(raw_file(good, 4), {"tensor 'a' ends at byte 8", "holds only 4"});  // truncated data
    expect_rejected(raw_file("{\"a\": ", 0), {"not valid JSON"});
    expect_rejected(raw_file("[1,2]", 0), {"not a JSON object"});
    expect_rejected(raw_file(R"({"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}})", 8),
                    {"dtype 'C64'"});
    expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                    {"needs 12 bytes", "span 8"});
    expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), {"backwards"});
    expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
                    {"non-negative"});
    expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2]}})", 8), {"data_offsets"});
    expect_rejected(raw_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8), {"dtype"});
    expect_rejected(
        raw_file(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})", 8),
        {"overflows"});
    expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                             12),
                    {"overlap"});
    expect_rejected(raw_file(R"({"__metadata__":{"k":1}})", 0), {"metadata value 'k'"});
}

TEST(Safetensors, MissingFileAndMissingKeyAreClear) {
    test::TempDir dir;
    try {
        SafetensorsFile f(dir / "absent.safetensors");
        FAIL();
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("absent.safetensors"), std::string::npos);
    }
    save_safetensors(dir / "x.safetensors", {{"w", at::ones({1})}});
    SafetensorsFile f(dir / "x.safetensors");
    try {
        f.get("missing.weight");
        FAIL();
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("'missing.weight'"), std::string::npos);
    }
}

TEST(Safetensors, WriterRejectsDuplicatesAndUnsupportedDTypes) {
    test::TempDir dir;
    EXPECT_THROW(save_safetensors(dir / "d.safetensors", {{"w", at::ones({1})}, {"w", at::ones({1})}}),
                 Error);
    EXPECT_THROW(save_safetensors(dir / "c.safetensors", {{"z", at::ones({1}, at::kComplexFloat)}}),
                 DataError);
    EXPECT_FALSE(std::filesystem::exists(dir / "d.safetensors"));
    EXPECT_FALSE(std::filesystem::exists(dir / "c.safetensors"));
}

TEST(Safetensors, MisalignedDataIsCopiedNotMisread) {
    // One U8 tensor of 1 byte shifts the following F32 to an odd offset.
    const std::string header =
        R"({"pad":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"F32","shape":[1],"data_offsets":[1,5]}})";
    float value = 1.5f;
    std::string data = std::string(1, '\x07') + std::string(reinterpret_cast<const char*>(&value), 4);
    std::string padded = header;
    while ((8 + padded.size()) % 8) padded += ' ';
    test::TempDir dir;
    test::write_bytes(dir / "m.safetensors", le64(padded.size()) + padded + data);
    SafetensorsFile f(dir / "m.safetensors");
    EXPECT_EQ(f.get("w").item<float>(), 1.5f);
    EXPECT_EQ(f.get("pad").item<uint8_t>(), 7);
}

TEST(Safetensors, ShardedSetsWriteAndReadBack) {
    test::TempDir dir;
    TensorList tensors;
    for (int i = 0; i < 7; ++i)
        tensors.emplace_back("layer." + std::to_string(i) + ".weight", at::full({256}, float(i)));
    // 1 KiB each, 2.5 KiB shards -> 2 per shard -> 4 shards.
    auto files = save_sharded_safetensors(dir.path(), "model", tensors, 2560, {{"format", "pt"}});
    ASSERT_EQ(files.size(), 5u);
    EXPECT_EQ(files[0].filename(), "model-00001-of-00004.safetensors");
    EXPECT_EQ(files.back().filename(), "model.safetensors.index.json");
    auto index = nlohmann::json::parse(fs::read_file(files.back()));
    EXPECT_EQ(index["metadata"]["total_size"], 7 * 1024);

    for (const auto& path : {files.back(), dir.path()}) {
        WeightSource src = WeightSource::open(path);
        EXPECT_EQ(src.files().size(), 4u);
        EXPECT_EQ(src.keys().size(), 7u);
        EXPECT_EQ(src.total_bytes(), 7u * 1024);
        for (const auto& [name, t] : tensors) EXPECT_TRUE(at::equal(src.get(name), t)) << name;
        EXPECT_THROW(src.get("layer.9.weight"), DataError);
    }
    // Small sets stay one file.
    test::TempDir one;
    auto single = save_sharded_safetensors(one.path(), "diffusion_pytorch_model", tensors, 1 << 20);
    ASSERT_EQ(single.size(), 1u);
    EXPECT_EQ(WeightSource::open(one.path(), "diffusion_pytorch_model").keys().size(), 7u);
}

TEST(Safetensors, ShardedIndexErrorsNameTheProblem) {
    test::TempDir dir;
    save_safetensors(dir / "s1.safetensors", {{"a", at::ones({1})}});
    fs::write_file_atomic(dir / "m.safetensors.index.json",
                          R"({"weight_map":{"a":"s1.safetensors","b":"s1.safetensors"}})");
    try {
        WeightSource::open(dir / "m.safetensors.index.json");
        FAIL();
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("'b'"), std::string::npos) << e.what();
    }
    fs::write_file_atomic(dir / "m.safetensors.index.json", R"({"weight_map":{"a":"gone.safetensors"}})");
    EXPECT_THROW(WeightSource::open(dir / "m.safetensors.index.json"), DataError);
    fs::write_file_atomic(dir / "m.safetensors.index.json", "not json");
    EXPECT_THROW(WeightSource::open(dir / "m.safetensors.index.json"), DataError);
    EXPECT_THROW(WeightSource::open(dir / "nowhere"), DataError);
    test::TempDir empty;
    EXPECT_THROW(WeightSource::open(empty.path()), DataError);
}

}  // namespace dtune::io
