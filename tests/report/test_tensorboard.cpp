// TensorBoard event files: CRC32C against the published check value, TFRecord framing, protobuf
// round trips, damage detection, and (when the tensorboard Python package is importable) that
// TensorBoard's own reader sees our scalars and images.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "core/error.h"
#include "report/tensorboard.h"
#include "support/test_support.h"

namespace dtune::report {
namespace test_tensorboard_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

TEST(TensorBoard, Crc32cMatchesTheStandardCheckValues) {
    // RFC 3720 / iSCSI check values for CRC-32C.
    EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
    EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
    EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);
    // TFRecord masking by its definition: rotate right 15, add 0xa282ead8.
    const uint32_t c = 0xE3069283u;
    EXPECT_EQ(masked_crc32c("123456789"), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TensorBoard, RecordFramingLayout) {
    const std::string rec = frame_record("abc");
    ASSERT_EQ(rec.size(), 8u + 4 + 3 + 4);
    EXPECT_EQ(static_cast<uint8_t>(rec[0]), 3);
    for (int i = 1; i < 8; ++i) EXPECT_EQ(rec[static_cast<size_t>(i)], 0);
    EXPECT_EQ(rec.substr(12, 3), "abc");
}

TEST(TensorBoard, EventProtobufHandEncoded) {
    Event e;
    e.wall_time = 0;
    e.step = 300;
    e.values.push_back({"a", 1.0f, std::nullopt});
    const std::string bytes = encode_event(e);
    // wall_time (field 1, fixed64) = 0; step (field 2, varint 300 = ac 02); summary (field 5) {
    // value (field 1) { tag (1) "a", simple_value (2, fixed32) 1.0f = 00 00 80 3f } }.
    const std::string expected(
        "\x09\0\0\0\0\0\0\0\0\x10\xac\x02\x2a\x0a\x0a\x08\x0a\x01"
        "a\x15\0\0\x80\x3f",
        24);
    EXPECT_EQ(bytes, expected);
    const Event back = decode_event(bytes, "test");
    EXPECT_EQ(back.step, 300);
    ASSERT_EQ(back.values.size(), 1u);
    EXPECT_EQ(back.values[0].tag, "a");
    EXPECT_FLOAT_EQ(*back.values[0].simple_value, 1.0f);
}

TEST(TensorBoard, WriterReaderRoundTripAndDamage) {
    test::TempDir dir;
    std::filesystem::path file;
    {
        EventWriter w(dir.path());
        file = w.path();
        for (int s = 1; s <= 5; ++s) w.add_scalar("train/loss", 1.0 / s, s);
        w.add_image("validation/x", ImageSummary{2, 1, 3, std::string("\x89PNG fake", 9)}, 5);
    }
    EXPECT_NE(file.filename().string().find("tfevents"), std::string::npos);
    const auto events = read_events(file);
    ASSERT_EQ(events.size(), 7u);
    EXPECT_EQ(events[0].file_version, "brain.Event:2");
    for (int s = 1; s <= 5; ++s) {
        EXPECT_EQ(events[static_cast<size_t>(s)].step, s);
        EXPECT_FLOAT_EQ(*events[static_cast<size_t>(s)].values.at(0).simple_value,
                        static_cast<float>(1.0 / s));
    }
    const auto& im = *events[6].values.at(0).image;
    EXPECT_EQ(im.width, 2);
    EXPECT_EQ(im.height, 1);
    EXPECT_EQ(im.png, std::string("\x89PNG fake", 9));

    // A truncated tail (writer killed mid-record) is ignored; a flipped payload byte is an error.
    std::string bytes;
    {
        std::ifstream in(file, std::ios::binary);
        bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    const auto cut = dir / "cut.tfevents";
    std::ofstream(cut, std::ios::binary) << bytes.substr(0, bytes.size() - 5);
    EXPECT_EQ(read_events(cut).size(), 6u);
    bytes[bytes.size() - 8] ^= 0x55;
    const auto bad = dir / "bad.tfevents";
    std::ofstream(bad, std::ios::binary) << bytes;
    EXPECT_THROW(read_events(bad), DataError);
}

// TensorBoard's own EventAccumulator reads the file (skipped when tensorboard is not installed;
// scripts/setup.sh installs it).
TEST(TensorBoard, TensorBoardPackageReadsOurFile) {
    if (std::system("python3 -c 'import tensorboard' >/dev/null 2>&1") != 0)
        GTEST_SKIP() << "python3 tensorboard not importable (pip install tensorboard)";
    test::TempDir dir;
    {
        EventWriter w(dir / "run");
        for (int s = 1; s <= 3; ++s) w.add_scalar("train/loss", 0.5 * s, s);
        // A real 1x1 PNG (red pixel), so TensorBoard's image plugin accepts it.
        static const unsigned char kPng[] = {
            0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48,
            0x44, 0x52, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x02, 0x00, 0x00,
            0x00, 0x90, 0x77, 0x53, 0xde, 0x00, 0x00, 0x00, 0x0c, 0x49, 0x44, 0x41, 0x54, 0x78,
            0x9c, 0x63, 0xf8, 0xcf, 0xc0, 0x00, 0x00, 0x03, 0x01, 0x01, 0x00, 0xc9, 0xfe, 0x92,
            0xef, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45, 0x4e, 0x44, 0xae, 0x42, 0x60, 0x82};
        w.add_image("validation/red",
                    ImageSummary{1, 1, 3, std::string(reinterpret_cast<const char*>(kPng), sizeof(kPng))}, 3);
    }
    const auto script = dir / "read.py";
    std::ofstream(script)
        << "import sys\n"
           "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
           "acc = EventAccumulator(sys.argv[1], size_guidance={'scalars': 0, 'images': 0})\n"
           "acc.Reload()\n"
           "s = acc.Scalars('train/loss')\n"
           "print(' '.join('%d:%g' % (e.step, e.value) for e in s))\n"
           "im = acc.Images('validation/red')\n"
           "print('img', len(im), im[0].step, im[0].width, im[0].height, len(im[0].encoded_image_string))\n";
    const auto out = dir / "out.txt";
    const std::string cmd =
        "python3 " + script.string() + " " + (dir / "run").string() + " > " + out.string() + " 2>&1";
    const int rc = std::system(cmd.c_str());
    std::ifstream in(out);
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    ASSERT_EQ(rc, 0) << text;
    EXPECT_NE(text.find("1:0.5 2:1 3:1.5"), std::string::npos) << text;
    EXPECT_NE(text.find("img 1 3 1 1 69"), std::string::npos) << text;
}

// A full disk between records (issue #20): every record is whole, none is lost, the order holds.
// Before: the failed write threw out of the training loop and left a partial record buffered.
TEST(TensorBoard, FullDiskHoldsRecordsAndWritesThemWholeOnceThereIsSpace) {
    test::SmallTmpfs disk(256 * 1024);
    if (!disk.mounted()) GTEST_SKIP() << disk.why();
    EventWriter w(disk / "logs");
    const auto filler = disk / "filler";
    ASSERT_GT(disk.fill(filler), 0u);
    // About 40 bytes a record: 300 of them cross several pages of the full file system.
    int step = 0;
    for (; step < 300; ++step) w.add_scalar("train/loss", 1.0 / (step + 1), step + 1);
    std::filesystem::remove(filler);
    ++step;
    w.add_scalar("train/loss", 1.0 / step, step);
    const auto events = read_events(w.path());
    ASSERT_EQ(events.size(), static_cast<size_t>(step) + 1);
    for (int s = 1; s <= step; ++s) {
        EXPECT_EQ(events[static_cast<size_t>(s)].step, s);
        EXPECT_FLOAT_EQ(*events[static_cast<size_t>(s)].values.at(0).simple_value,
                        static_cast<float>(1.0 / s));
    }
}

}  // namespace
}  // namespace test_tensorboard_local
}  // namespace dtune::report
