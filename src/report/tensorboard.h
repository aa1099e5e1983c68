// TensorBoard event files, written and read without TensorFlow: the TFRecord framing
// (u64 length, masked CRC32C of the length, payload, masked CRC32C of the payload) around
// hand-encoded `tensorflow.Event` protobufs holding scalar and PNG-image summaries.
//
// Invariants: every record is flushed whole (a reader that hits a partial tail stops there); the
// first record is the `file_version: "brain.Event:2"` event TensorBoard expects; field numbers
// follow tensorflow/core/util/event.proto and summary.proto (Event: wall_time 1, step 2,
// file_version 3, summary 5; Summary.value 1; Value: tag 1, simple_value 2, image 4; Image:
// height 1, width 2, colorspace 3, encoded_image_string 4). Needs no TensorFlow or torch code.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dtune::fs {
class AppendLog;
}

namespace dtune::report {

// CRC-32C (Castagnoli), and TFRecord's masking of it: rotate right by 15, add 0xa282ead8.
uint32_t crc32c(std::string_view data);
uint32_t masked_crc32c(std::string_view data);

// One TFRecord: length, masked CRC of the length, payload, masked CRC of the payload.
std::string frame_record(std::string_view payload);

struct ImageSummary {
    int width = 0;
    int height = 0;
    int colorspace = 3;  // RGB
    std::string png;     // the encoded image bytes
};

// A decoded event (the fields dtune writes).
struct Event {
    double wall_time = 0;
    int64_t step = 0;
    std::string file_version;  // only in the first event
    struct Value {
        std::string tag;
        std::optional<float> simple_value;
        std::optional<ImageSummary> image;
    };
    std::vector<Value> values;
};

// The protobuf bytes of an Event (encoding is exposed for tests).
std::string encode_event(const Event& event);
// DataError when the bytes are not a well-formed Event.
Event decode_event(std::string_view bytes, const std::string& where);

// Appends events to `<dir>/events.out.tfevents.<unix time>.<host>.<pid>.dtune` (TensorBoard
// matches the "tfevents" part). Each add_* writes one whole record (fs::AppendLog): when the disk is
// full the record is held, the file still ends with a whole record, and later writes retry it.
class EventWriter {
  public:
    explicit EventWriter(const std::filesystem::path& dir);
    ~EventWriter();
    EventWriter(const EventWriter&) = delete;
    EventWriter& operator=(const EventWriter&) = delete;

    void add_scalar(const std::string& tag, double value, int64_t step);
    void add_image(const std::string& tag, const ImageSummary& image, int64_t step);
    const std::filesystem::path& path() const { return path_; }
    // Records not written yet (disk full), why the last write failed, and one more try.
    std::size_t held() const;
    const std::string& error() const;
    bool retry();

  private:
    void write(const Event& event);

    std::filesystem::path path_;
    std::unique_ptr<fs::AppendLog> log_;
};

// Reads every complete record of an event file; DataError naming the file and offset on a bad
// CRC. A truncated final record (a writer killed mid-write) ends the list without error.
std::vector<Event> read_events(const std::filesystem::path& file);

}  // namespace dtune::report
